"""LoRA adapters as data: finding them beside their Q8_0 params, taking them out, putting them in.

An adapter is the pair A (K, rank), B (rank, N) that `Q8LoraProvider` trains for one Q8 param,
and the alpha of the rule it was trained under (the delta is x @ A @ B * alpha / rank). Its key is
the path of the Q8 param it adapts, joined with '/' ('blocks/0/attn/qkv/kernel'): A and B sit
beside that param as `<name>_lora_a` / `<name>_lora_b` (linen: entries of the params dict; nnx:
`nnx.LoRAParam` attributes of the module), and its module path ('blocks/0/attn/qkv') is what a
rule's `module_path` matched.

A's rows are the rows of the Q8 param's (K, N) matrix (`q8rules.layout`: the contracted axes of
the weight flattened in its axis order, K before padding) and B's columns its columns, whatever
the op (Dense, an N-D einsum, a tied head reading an embedding table (V, D) stored as K = D,
N = V). So `A @ B` is a delta of that matrix, with no further layout.

Param trees here are linen's params collection (nested dicts, `variables['params']`) or an nnx
model (as `qwix.apply_lora_to_model` made it). What these functions return for nnx is a pure
dict of state, for `nnx.update(model, ...)`, as `q8rules.quantize_params` returns.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax
import jax
import numpy as np
from flax import nnx

from q8rules._qwix import QuantizationProvider, provider_rules, unbox
from q8rules.layout import Q8How
from q8rules.lora.provider import LORA_A, LORA_B, Q8LoraRule
from q8rules.providers.q8_weight import as_q8_weight
from q8rules.q8_0 import Q8Array
from q8rules.rules import Q8Rule, describe
from q8rules.tree_paths import listing

Path = tuple[Any, ...]
"""A param's path as the tree holds it (dict keys; nnx attribute names and list indices)."""


def path_name(path: Path) -> str:
  """'a/b/kernel' for ('a', 'b', 'kernel'): how adapters are keyed and errors name params."""
  return "/".join(map(str, path)) or "(root)"


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
  """One adapter: the delta `A @ B * alpha / rank` of its Q8 param's (K, N) matrix.

  Attributes:
    a: A, float32 (K, rank), K the Q8 param's contracted size before padding; a stack of
      experts' (*E, K, rank), one per expert.
    b: B, float32 (rank, N); a stack's (*E, rank, N).
    alpha: the rule's alpha (> 0); the delta's scale is alpha / rank.
  """

  a: Any
  b: Any
  alpha: float

  @property
  def rank(self) -> int:
    return int(self.a.shape[-1])

  @property
  def scale(self) -> float:
    """alpha / rank (a Python float: computed in float64)."""
    return float(self.alpha) / self.rank

  def check(self, where: str) -> None:
    """Raise ValueError, naming `where`, unless A is (K, r) and B (r, N) float32 (or one of each
    per expert of a stack: (*E, K, r) and (*E, r, N)) and alpha > 0."""
    a_shape, b_shape = tuple(self.a.shape), tuple(self.b.shape)
    same_experts = len(a_shape) == len(b_shape) >= 2 and a_shape[:-2] == b_shape[:-2]
    if not same_experts or a_shape[-1] != b_shape[-2] or a_shape[-1] < 1:
      raise ValueError(
        f"{where}: LoRA A of shape {a_shape} and B of shape {b_shape} are not (K, rank) and"
        " (rank, N) of one rank (or one of each per expert, with the same experts)"
      )
    for part, value in (("A", self.a), ("B", self.b)):
      if np.dtype(value.dtype) != np.float32:
        raise ValueError(f"{where}: LoRA {part} is {np.dtype(value.dtype)}, not float32")
    alpha = self.alpha
    if isinstance(alpha, bool) or not (
      isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0
    ):
      raise ValueError(f"{where}: LoRA alpha={alpha!r} is not a finite number > 0")


Adapters = dict[str, LoraAdapter]
"""Adapters by the '/'-joined path of the Q8 param each adapts."""


# ---- the rule an adapter was trained under -----------------------------------


def rules_of(lora: QuantizationProvider | Sequence[Q8Rule], what: str) -> list[Q8Rule]:
  """The rules of a provider, or a sequence of rules, in Qwix's matching order."""
  if isinstance(lora, QuantizationProvider):
    return list(provider_rules(lora))
  if isinstance(lora, Sequence) and not isinstance(lora, str):
    rules = list(lora)
    if all(isinstance(r, Q8Rule) for r in rules):
      return rules
  raise TypeError(
    f"{what}: expected a Q8LoraProvider or a sequence of Q8Rules (the rules the adapters were"
    f" trained under), got {type(lora).__name__}"
  )


def rule_alpha(rules: Sequence[Q8Rule], module: str, rank: int, where: str) -> float:
  """The alpha of the `Q8LoraRule` that put an adapter of `rank` on the module `module`.

  Qwix takes the first rule whose `module_path` fully matches the module path and whose
  `op_names` (when set) hold the op; the op is not known here, so every `Q8LoraRule` up to the
  first matching rule without `op_names` may have made the adapter. They must agree.

  Raises:
    ValueError naming `where`: no such rule; none of that rank; candidates whose alphas differ.
  """
  candidates = []
  for rule in rules:
    if re.fullmatch(rule.module_path, module):
      if isinstance(rule, Q8LoraRule):
        candidates.append(rule)
      if not rule.op_names:
        break
  if not candidates:
    raise ValueError(
      f"{where}: no Q8LoraRule matches its module path {module!r}, so its alpha is unknown"
      " (pass the rules the adapter was trained under)"
    )
  fitting = [r for r in candidates if r.rank == rank]
  if not fitting:
    raise ValueError(
      f"{where}: the adapter has rank {rank}, but the Q8LoraRule(s) matching module path"
      f" {module!r} have rank {sorted({r.rank for r in candidates})}: "
      + "; ".join(describe(r) for r in candidates)
    )
  alphas = sorted({float(r.alpha) for r in fitting})
  if len(alphas) > 1:
    raise ValueError(
      f"{where}: ambiguous: Q8LoraRules of rank {rank} with alphas {alphas} all match module"
      f" path {module!r} (which one applies depends on the op): "
      + "; ".join(describe(r) for r in fitting)
    )
  return alphas[0]


# ---- param trees -------------------------------------------------------------


def _is_adapter_name(path: Path) -> bool:
  """Whether the leaf at `path` is named as an adapter param ('kernel_lora_a', '..._lora_b')."""
  return isinstance(path[-1], str) and path[-1].endswith((LORA_A, LORA_B))


def module_of(path: Path) -> str:
  """The module path of the param at `path`, as rules match it ('' for the top module)."""
  return "/".join(map(str, path[:-1]))


@dataclasses.dataclass
class Tree:
  """A linen params dict or an nnx model, flattened for reading and rewriting.

  Attributes:
    flat: path -> leaf. linen: the params' leaves as stored (boxed ones included); nnx: the
      model's pure state, a Q8 param as its two leaves `path + ('array', 'q' | 'scale')`.
    model: the nnx model (None for linen).
    lora: the paths of the adapter leaves in `flat` (nnx: its `nnx.LoRAParam`s; linen: the
      leaves named `<name>_lora_a` / `<name>_lora_b`).
  """

  flat: dict[Path, Any]
  model: nnx.Module | None
  lora: set[Path]

  @classmethod
  def of(cls, params: Any, what: str) -> Tree:
    if isinstance(params, nnx.Module):
      flat = flax.traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(params)))
      lora_state = nnx.to_pure_dict(nnx.state(params, nnx.LoRAParam))
      lora = {p for p in flax.traverse_util.flatten_dict(lora_state) if _is_adapter_name(p)}
      return cls(flat, params, lora)
    if isinstance(params, nnx.State):
      raise TypeError(
        f"{what}: an nnx.State does not hold the Q8 params' layouts (K before padding); pass"
        " the nnx model itself"
      )
    if not isinstance(params, Mapping):
      raise TypeError(
        f"{what}: expected a linen params dict (variables['params']) or an nnx model, got"
        f" {type(params).__name__}"
      )
    flat = flax.traverse_util.flatten_dict(
      flax.core.unfreeze(params), is_leaf=lambda _, v: not isinstance(v, Mapping)
    )
    return cls(flat, None, {p for p in flat if _is_adapter_name(p)})

  def q8(self, path: Path) -> tuple[Q8Array, Q8How] | None:
    """The Q8 param at `path` (its values and scales, and its layout), or None."""
    if self.model is None:
      leaf = self.flat.get(path)
      weight = None if leaf is None else as_q8_weight(leaf)
      return None if weight is None else (weight.array, weight.how)
    if path + ("array", "q") not in self.flat:
      return None
    node: Any = self.model
    for key in path:
      try:
        node = getattr(node, key) if isinstance(key, str) else node[key]
      except (AttributeError, KeyError, IndexError, TypeError):
        return None
    weight = as_q8_weight(node)
    if weight is None:
      return None
    q, scale = self.flat[path + ("array", "q")], self.flat[path + ("array", "scale")]
    return dataclasses.replace(weight.array, q=q, scale=scale), weight.how

  def q8_paths(self) -> dict[str, Path]:
    """Every Q8 param's path, by its name ('up/kernel')."""
    if self.model is None:
      paths = [p for p, v in self.flat.items() if as_q8_weight(v) is not None]
    else:
      paths = [p[:-2] for p in self.flat if p[-2:] == ("array", "q")]
    return {path_name(p): p for p in paths}

  def leaf(self, path: Path) -> Any:
    """The array at `path`, unboxed."""
    value = unbox(self.flat[path])
    return value[...] if isinstance(value, nnx.Variable) else value

  def adapter_sites(self) -> dict[Path, tuple[Path, Path]]:
    """The Q8 param's path -> the paths of its A and B, for every adapter leaf of the tree.

    Raises:
      ValueError naming the param: an A without its B or the other way round.
    """
    sites: dict[Path, tuple[Path, Path]] = {}
    problems = []
    for path in sorted(self.lora, key=path_name):
      name = path[-1]
      this, other = (LORA_A, LORA_B) if name.endswith(LORA_A) else (LORA_B, LORA_A)
      base = path[:-1] + (name[: -len(this)],)
      partner = base[:-1] + (base[-1] + other,)
      if partner not in self.lora:
        problems.append(f"{path_name(path)} without {path_name(partner)}")
      elif this == LORA_A:
        sites[base] = (path, partner)
    if problems:
      raise ValueError(
        "LoRA params without their other half (an A needs its B, named alike):\n"
        + listing(problems)
      )
    return sites

  def unflatten(self, flat: dict[Path, Any]) -> Any:
    """`flat` (paths of this tree's kind) back into nested dicts."""
    return flax.traverse_util.unflatten_dict(flat)

  def base_flat(self) -> dict[Path, Any]:
    """`flat` without the adapter leaves."""
    return {p: v for p, v in self.flat.items() if p not in self.lora}


def checked_site(tree: Tree, base: Path, adapter: LoraAdapter) -> tuple[Q8Array, Q8How]:
  """The Q8 param at `base` that `adapter` adapts, with the adapter's shapes checked against it.

  Raises:
    ValueError naming the param: no Q8 param there, a stacked one (leading axes that are not its
    layout's experts), or A and B that are not (K, rank) and (rank, N) of its (K, N) matrix (one
    of each per expert of a stack of experts).
  """
  where = path_name(base)
  adapter.check(f"LoRA adapter of {where}")
  found = tree.q8(base)
  if found is None:
    raise ValueError(
      f"LoRA adapter of {where}: the params hold no Q8 param {where} for it to adapt"
    )
  q8, how = found
  experts = how.layout.batch_shape
  if q8.ndim != 2 + len(experts) or q8.axis != len(experts):
    raise ValueError(
      f"{where}: its Q8 values are {q8.shape} blocked along axis {q8.axis}; LoRA adapters fit"
      " one (K_padded, N) matrix blocked along K, or a stack of experts (stacked layers are not"
      " handled)"
    )
  k, n = how.layout.k, how.layout.n
  if tuple(q8.shape) != how.layout.stored_shape:
    raise ValueError(f"{where}: Q8 values of shape {q8.shape} do not match its layout {how.layout}")
  want_a, want_b = (*experts, k, adapter.rank), (*experts, adapter.rank, n)
  if tuple(adapter.a.shape) != want_a or tuple(adapter.b.shape) != want_b:
    raise ValueError(
      f"{where}: LoRA A {tuple(adapter.a.shape)} and B {tuple(adapter.b.shape)} do not fit its"
      f" Q8 weight (float shape {how.layout.shape}, K={k}, N={n}): want A {want_a}, B {want_b}"
    )
  return q8, how


def split_lora(params: Any, lora: QuantizationProvider | Sequence[Q8Rule]) -> tuple[Any, Adapters]:
  """The base params and the adapters, apart.

  Args:
    params: linen's params collection of a `Q8LoraProvider` model, or the nnx model
      (`qwix.apply_lora_to_model`).
    lora: the `Q8LoraProvider` (or its rules) the adapters were trained under: each adapter's
      alpha is its rule's (`rule_alpha`).

  Returns:
    (base, adapters): base, the params without the adapter leaves (linen: a dict for a plain
    `Q8Provider` model; nnx: a pure dict of the rest of the state); adapters, a dict from the
    adapted Q8 param's path ('up/kernel') to a `LoraAdapter` of host (numpy) float32 A, B.

  Raises:
    ValueError naming the param: an adapter whose shapes do not fit its Q8 param, an A without
    its B, no rule or an ambiguous one for its module; none in the tree at all.
    TypeError: params or lora of another kind.
  """
  rules = rules_of(lora, "split_lora")
  tree = Tree.of(params, "split_lora")
  sites = tree.adapter_sites()
  if not sites:
    raise ValueError(
      "split_lora: the params hold no LoRA adapter (no '<name>_lora_a' / '<name>_lora_b' beside"
      " a Q8 param)"
    )
  adapters: Adapters = {}
  for base, (pa, pb) in sites.items():
    where = f"LoRA adapter of {path_name(base)}"
    a, b = np.asarray(tree.leaf(pa)), np.asarray(tree.leaf(pb))
    alpha = rule_alpha(rules, module_of(base), a.shape[-1], where)
    adapter = LoraAdapter(a=a, b=b, alpha=alpha)
    checked_site(tree, base, adapter)
    adapters[path_name(base)] = adapter
  return tree.unflatten(tree.base_flat()), adapters


def placed_like(value: Any, old: Any) -> Any:
  """`value` as a jax array where `old` (a jax array) lives, with its sharding; else as is."""
  old = unbox(old)
  old = old[...] if isinstance(old, nnx.Variable) else old
  if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
    return jax.device_put(np.asarray(value), old.sharding)
  return jax.numpy.asarray(value)


def reboxed(old: Any, value: Any) -> Any:
  """`value` in `old`'s box (a Flax `AxisMetadata`, e.g. nn.Partitioned), if it had one."""
  if isinstance(old, flax.core.meta.AxisMetadata):
    return old.replace_boxed(value)
  return value


def join_lora(
  params: Any, adapters: Mapping[str, LoraAdapter], lora: QuantizationProvider | Sequence[Q8Rule]
) -> Any:
  """The params with `adapters` in them, for the `Q8LoraProvider` model of `lora` to run.

  Args:
    params: linen: a params dict holding the Q8 params (with or without adapters: those given
      are set, others kept); nnx: the model made by `qwix.apply_lora_to_model` (its
      `nnx.LoRAParam`s are what gets set).
    adapters: from `split_lora` or `q8rules.load_lora`, by Q8 param path.
    lora: the provider (or rules) the model runs under: each adapter's rank and alpha must be
      those of the rule that matches its module, or the model would scale it differently.

  Returns:
    linen: the params dict; nnx: a pure dict of the model's state, for `nnx.update(model, ...)`.
    A and B go where the params' own arrays lived (device and sharding), as float32.

  Raises:
    ValueError naming the param: no Q8 param at an adapter's path, shapes that do not fit it,
    an alpha or rank other than its rule's, an nnx model without LoRA params there.
  """
  rules = rules_of(lora, "join_lora")
  tree = Tree.of(params, "join_lora")
  flat = dict(tree.flat)
  by_name = tree.q8_paths()
  for name, adapter in adapters.items():
    where = f"LoRA adapter of {name}"
    base = by_name.get(name)
    if base is None:
      raise ValueError(f"{where}: the params hold no Q8 param {name} for it to adapt")
    checked_site(tree, base, adapter)
    module = module_of(base)
    alpha = rule_alpha(rules, module, adapter.rank, where)
    if alpha != float(adapter.alpha):
      raise ValueError(
        f"{where}: its alpha {adapter.alpha} is not {alpha}, the alpha of the rule matching"
        f" module path {module!r}: the model would scale it by {alpha}/{adapter.rank}"
      )
    for suffix, value in ((LORA_A, adapter.a), (LORA_B, adapter.b)):
      path = base[:-1] + (base[-1] + suffix,)
      if tree.model is not None and path not in tree.lora:
        raise ValueError(
          f"{where}: the nnx model has no LoRA param {path_name(path)}; make it with"
          " qwix.apply_lora_to_model(model, provider, ...) whose rules adapt that module"
        )
      old, value = flat.get(path), np.asarray(value, np.float32)
      flat[path] = (
        jax.numpy.asarray(value) if old is None else reboxed(old, placed_like(value, old))
      )
  return tree.unflatten(flat)


__all__ = [
  "Adapters",
  "LoraAdapter",
  "Tree",
  "checked_site",
  "join_lora",
  "module_of",
  "path_name",
  "placed_like",
  "reboxed",
  "rule_alpha",
  "rules_of",
  "split_lora",
]
