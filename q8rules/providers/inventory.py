"""Which weights a provider has seen, which it served as Q8_0, and why the others stayed float:
what `report().float_params` lists, so that no weight under a matched module stays float in
silence."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax
from flax import nnx

from q8rules._qwix import unbox
from q8rules.providers.q8_weight import as_q8_weight
from q8rules.report import FloatParam
from q8rules.rules import Q8Rule

NOT_SERVED = "used by no served product (outside a product, or by an op q8rules does not serve)"
"""The reason given for a weight no intercepted product or lookup of it stayed float on."""

NOT_WEIGHTS = re.compile(r"(^|/)\w*(bias|scale|_lora_a|_lora_b)$")
"""Param names that are never a served product's weight (biases, norm scales, LoRA adapters,
which stay float by design): not listed."""


class ParamInventory:
  """The params of two or more axes of the modules that ran an intercepted op.

  Attributes:
    params: param path -> (its module's path, its float shape).
    served: the paths of the params served (or fake-quantised) as Q8_0 so far.
    float_reasons: param path -> why a product or lookup of it stayed float.
  """

  def __init__(self) -> None:
    self.params: dict[str, tuple[str, tuple[int, ...]]] = {}
    self.served: set[str] = set()
    self.float_reasons: dict[str, str] = {}
    self._models: set[int] = set()

  def take(self, module_path: str, params: Iterable[tuple[str, Any]]) -> None:
    """Note a module's params ((param path, unboxed value) each): a Q8 param is served, a float
    one of two or more axes is listed."""
    for where, value in params:
      if as_q8_weight(value) is not None:
        self.served.add(where)
      elif len(getattr(value, "shape", ())) >= 2 and not NOT_WEIGHTS.search(where):
        self.params.setdefault(where, (module_path, tuple(value.shape)))

  def take_model(self, model: Any, model_args: Sequence[Any]) -> None:
    """Note every param of a model about to run: an nnx model's own, or a linen `apply`'s
    `variables['params']` (its first argument). Once a model: later runs of it have the same
    params, and what they serve is noted as they serve it."""
    if id(model) in self._models:
      return
    entries: list[tuple[tuple[str, ...], Any]] = []
    if isinstance(model, nnx.Module):
      for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
          entries.append((tuple(map(str, path)), node.get_value()))
    elif model_args and isinstance(model_args[0], Mapping) and "params" in model_args[0]:
      params = model_args[0]["params"]
      params = params.unfreeze() if hasattr(params, "unfreeze") else params
      flat = flax.traverse_util.flatten_dict(params, is_leaf=lambda _, v: not isinstance(v, dict))
      entries = [(tuple(map(str, k)), unbox(v)) for k, v in flat.items()]
    if entries:
      self._models.add(id(model))
    for path, value in entries:
      if len(path) > 2 and path[-2] == "array" and path[-1] in ("q", "scale"):
        self.served.add("/".join(path[:-2]))  # an nnx Q8 param's parts
        continue
      self.take("/".join(path[:-1]), [("/".join(path), value)])

  def matched(self, rule: Q8Rule, modules: Iterable[str] | None = None) -> list[str]:
    """The params listed under modules `rule` matches: its `module_path` (as Qwix matches it),
    and where the rule names ops, only `modules` (those where it matched an op)."""
    ran = None if modules is None else set(modules)
    return [
      where
      for where, (module, _) in self.params.items()
      if re.fullmatch(rule.module_path, module)
      and (not rule.op_names or ran is None or module in ran)
    ]

  def float_params(
    self, rules: Sequence[Q8Rule], ran: Mapping[int, Iterable[str]]
  ) -> list[FloatParam]:
    """Every listed param under a module one of `rules` matches that was not served, with why;
    `ran`: rule index -> the modules where it matched an op."""
    matched = {w for i, rule in enumerate(rules) for w in self.matched(rule, ran.get(i, ()))}
    return [
      FloatParam(where, shape, self.float_reasons.get(where, NOT_SERVED))
      for where, (_, shape) in sorted(self.params.items())
      if where in matched and where not in self.served
    ]


__all__ = ["NOT_SERVED", "ParamInventory"]
