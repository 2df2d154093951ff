"""The contract between Qwix's interception and a mode: `WeightPolicy`, and `PolicyProvider`,
the Qwix provider that hands every intercepted op on a weight to its policy.

A mode (serving as Q8_0, QAT's fake quant, LoRA on a Q8_0 base) is a `WeightPolicy`: what it
does with a product whose weight operand `tracking` found (`product`), with a lookup in a float
table (`lookup`) and in a stored Q8_0 table (`q8_lookup`). The policy owns what one run has
seen (`run`, a `tracking.RunState`) and the op report (`records`); the provider owns the
interception and starts and ends runs. Each mode is one file: `serving.py` (`ServePolicy`,
`Q8Provider`), `qat.py` (`FakeQuantPolicy`, `Q8QatProvider`), and the LoRA provider
(`LoraPolicy`, `Q8LoraProvider`).

One policy in every mode (eager, `jit`, `eval_shape`, `grad`), decided from what the current
run has seen, never from an earlier run:

  * A product whose weight is a param, or a param after `astype` / `.T` / `transpose` /
    `reshape`, quantizes the param itself, in its own shape and dtype (what
    `quantize_params` quantizes), stores it, and serves the view from it. QAT
    fake-quantises the param and applies the same ops.
  * A lookup (`jnp.take`, `table[ids]`) of a param a rule matches (op name 'take') stores
    the table as Q8_0 with the looked-up axis as N and reads the looked-up columns; QAT
    fake-quantises the table, then looks it up. A tied head (`x @ E.T`) then serves its
    product from the same stored values: one copy, the lookup and the head agree.
  * A lookup no rule matches, or of a float table given to a linen model's `apply`, runs
    float, and a later product on that param in the same run stays float too. A param
    already stored as Q8_0 (or fake-quantised this run) is always looked up from its Q8_0
    values.

Adding an op on weights (docs/design.md, "Adding an op"): one interception entry in
`PolicyProvider.product_intercepts` (or `tracking.intercepts` for an op that only derives a
view of a weight), which builds the op's `Product`, and one method per mode where the op needs
more than `product`.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules._qwix import (
  current_module_path,
  current_rule_and_op_id,
  derives_unchanged,
  find_param,
  get_current_module,
  initial_run_complete,
  module_params,
  provider_rules,
  unbox,
)
from q8rules.layout import (
  ProductLayout,
  Q8How,
  UnsupportedProduct,
  WeightLayout,
)
from q8rules.providers import lookup, model_hooks, tracking, views
from q8rules.providers.inventory import ParamInventory
from q8rules.providers.placement import annotation, param_path, stored_layout
from q8rules.providers.products import Product, ProductIntercepts
from q8rules.providers.q8_weight import Q8Weight
from q8rules.providers.tracking import Derived, RunState
from q8rules.report import FloatParam, OpRecord, Report
from q8rules.rules import KEPT, Q8Rule, describe, kept_float, validate_rule

RunOn = Callable[[Any], jax.Array]
"""`run_on(table)`: the model's own lookup op with `table` for the param's value."""

CurrentRule = Callable[[str], tuple[Q8Rule | None, str]]
"""op name ('dot_general', 'einsum', 'take') -> (the rule matching the op being intercepted,
or None; its op id, e.g. 'dot_general0')."""


def op_where(op_id: str) -> str:
  """'module/path/op_id', how error messages name an op."""
  return f"{current_module_path() or '(top module)'}/{op_id}"


def stored_how(found: Derived, view: WeightLayout, scale_dtype: str) -> Q8How:
  """How the param of `found` is stored as Q8_0 for a product (or lookup) of layout `view` of
  it: the param's own layout (an annotated split of a free axis moved to the front of N), its
  scale dtype and float dtype."""
  box = module_params(found.module)[found.name]
  layout = stored_layout(base_layout(found, view), found.chain, annotation(box))
  return Q8How(layout, scale_dtype, np.dtype(found.base.dtype).name)


def base_layout(found: Derived, view: WeightLayout) -> WeightLayout:
  """The param's own layout for the product (or lookup) layout `view` of `found`."""
  try:
    return views.base_layout(view, found.chain, found.shapes)
  except views.ViewError as e:
    raise ValueError(f"{found.name}: {views.describe(found.chain)}: {e}") from None


def weight_note(weight: Any, k: int, k_pad: int) -> str:
  """The report's note on a served product: K padding, and the param a view is of."""
  notes = [f"K padded {k} -> {k_pad}"] if k_pad != k else []
  if isinstance(weight, Q8Weight) and weight.chain:
    notes.append(f"weight {weight.name} as {views.describe(weight.chain)}")
  return "; ".join(notes)


class WeightPolicy(abc.ABC):
  """What a mode does with the weights of the ops its provider intercepts.

  Subclasses implement `product`, `lookup` and `q8_lookup`; the rest (finding the param an
  operand is, recording the report) is shared.

  Attributes:
    rules: the provider's rules, in order (the report names a rule by its index).
    current_rule: the rule and op id of the op being intercepted (`CurrentRule`).
    run: what the current run has seen (reset by `start_run`).
    records: (module path, op id) -> the latest `OpRecord` of each intercepted op.
    inventory: the weights of the modules that ran an intercepted op, which were served and
      why the others stayed float (`report().float_params`).
  """

  def __init__(self, rules: Sequence[Q8Rule], current_rule: CurrentRule):
    self.rules = list(rules)
    self.current_rule = current_rule
    self.run = RunState()
    self.records: dict[tuple[str, str], OpRecord] = {}
    self.inventory = ParamInventory()

  # ---- what a mode does ------------------------------------------------------

  @abc.abstractmethod
  def product(self, product: Product) -> jax.Array:
    """The intercepted product's output (the op's shape and dtype), recorded."""

  @abc.abstractmethod
  def lookup(
    self, found: Derived, arr: jax.Array, ids: Any, axis: int, mode: Any, run_on: RunOn
  ) -> jax.Array:
    """A lookup in the float table param `found` (value `arr`) of `ids` along `axis`
    (`take_q8`'s `mode`); `run_on(table)` runs the model's own op on another table value."""

  @abc.abstractmethod
  def q8_lookup(self, table: Q8Weight, ids: Any, axis: int, mode: Any = None) -> jax.Array:
    """A lookup in a table stored as Q8_0 (any rule)."""

  # ---- runs and the report ---------------------------------------------------

  def start_run(self) -> None:
    """A run starts (or ends): nothing of the last one is carried over, and its arrays go."""
    self.run = RunState()

  def record(self, rule: Q8Rule | None, op_id: str, path: str, **fields: Any) -> None:
    """Put the op being intercepted in the report (path 'cpu', 'fold', 'float', ...)."""
    module = current_module_path()
    index = None if rule is None else self.rules.index(rule)
    first = (module, op_id) not in self.records
    self.records[(module, op_id)] = OpRecord(module, op_id, index, path, **fields)
    if not first:  # the module's params were noted when its op was first recorded
      return
    try:
      current = get_current_module()
    except ValueError:
      return
    params = module_params(current).items()
    self.inventory.take(module, ((param_path(current, n), unbox(b)) for n, b in params))

  def matched_modules(self) -> dict[int, set[str]]:
    """Rule index -> the modules where the rule matched an intercepted op."""
    out: dict[int, set[str]] = {}
    for r in self.records.values():
      if r.rule is not None:
        out.setdefault(r.rule, set()).add(r.module)
    return out

  def float_params(self) -> list[FloatParam]:
    """`report().float_params`: every weight under a matched module left float, with why."""
    return self.inventory.float_params(self.rules, self.matched_modules())

  def record_lookup(
    self,
    rule: Q8Rule | None,
    op_id: str,
    path: str,
    layout: WeightLayout,
    ids: Any,
    dtypes: tuple[Any, Any],
    note: str,
  ) -> None:
    """Put a lookup in the report (path 'lookup', 'fake_quant' or 'float'); `dtypes`: the
    table's scale dtype and float dtype."""
    scale, dtype = (np.dtype(d).itemsize for d in dtypes)
    self.record(rule, op_id, path, note=note, **lookup.record_fields(layout, ids, scale, dtype))

  # ---- finding the weight -----------------------------------------------------

  def operand(self, rhs: Any) -> tuple[Derived | None, str]:
    """The param a float operand is (exactly, or through recorded ops; else by Qwix's own
    heuristics), or None and why the product stays float."""
    found = self.run.find(rhs)
    if found is None:  # Qwix's own search: through any op when traced, or by shape
      name = find_param(rhs)
      if not name:
        return None, "operand is not a weight"
      module = get_current_module()
      if not derives_unchanged(rhs, unbox(module_params(module)[name])):
        # derived through an op not carried (tracking's): serving it would store the derived
        # value in the param's place
        why = (
          f"derives from {name} through an op q8rules does not carry (astype, .T, transpose,"
          " reshape, w[i], w * c and Flax's dtype promotion are carried): left float"
        )
        self.inventory.float_reasons.setdefault(param_path(module, name), why)
        return None, why
      found = Derived(module, name, rhs)
    if found.key in self.run.float_lookups:
      return None, (
        f"{found.name} was looked up float in this run (no rule matched the lookup): the tied"
        " product stays float"
      )
    return found, ""

  def match_float_weight(self, product: Product) -> tuple[Derived, ProductLayout] | None:
    """The param (`Derived`: also through astype / .T / reshape) and product layout of a float
    weight a rule matched, or None when the op stays float (recorded, with a warning where a
    matched weight cannot be served).

    Raises TypeError on a matched weight that is not float.
    """
    rule, op_id, rhs = product.rule, product.op_id, product.rhs
    if rule is None:
      self.record(rule, op_id, "float", note="no rule matched")
      return None
    found, why_float = self.operand(rhs)
    if found is None:
      self.record(rule, op_id, "float", note=why_float)
      return None
    where = param_path(found.module, found.name)
    kept = kept_float(rule, where)
    if kept is not None:
      self.inventory.float_reasons[where] = kept
      self.record(rule, op_id, "float", weight_shape=tuple(rhs.shape), note=kept)
      return None
    try:
      layout = product.make_layout(tuple(rhs.shape))
    except UnsupportedProduct as e:
      warnings.warn(f"{op_where(op_id)}: left float: {e}", stacklevel=5)
      self.inventory.float_reasons[where] = f"an op that is not served: {e}"
      self.record(rule, op_id, "float", note=f"left float: {e}")
      return None
    if not jnp.issubdtype(rhs.dtype, jnp.floating):
      raise TypeError(
        f"{op_where(op_id)}: weight {found.name!r} has dtype {rhs.dtype}; Q8_0 quantizes float"
        " weights"
      )
    return found, layout

  def lookup_layout(
    self, found: Derived, rule: Q8Rule | None, op_id: str, shape: Any, axis: int
  ) -> WeightLayout | None:
    """The lookup layout of the table `found`, or None (recorded float, with a warning and the
    reason kept for the report) when a lookup in it is not served from Q8_0
    (`lookup.lookup_layout`: 2-D tables only)."""
    try:
      return lookup.lookup_layout(tuple(shape), axis)
    except lookup.UnsupportedLookup as e:
      warnings.warn(f"{op_where(op_id)}: left float: {e}", stacklevel=5)
      where = param_path(found.module, found.name)
      self.inventory.float_reasons.setdefault(where, f"a lookup that is not served: {e}")
      self.record(rule, op_id, "float", weight_shape=tuple(shape), note=f"left float: {e}")
      return None

  def as_float(
    self,
    found: Derived,
    rule: Q8Rule | None,
    op_id: str,
    arr: jax.Array,
    note: str,
    run_on: RunOn,
  ) -> jax.Array:
    """A lookup left float (recorded with `note`): the param's products stay float this run."""
    self.run.float_lookups.add(found.key)
    self.inventory.float_reasons.setdefault(param_path(found.module, found.name), note)
    self.record(rule, op_id, "float", weight_shape=tuple(arr.shape), note=note)
    return run_on(arr)


class PolicyProvider(ProductIntercepts):
  """Mixed into a Qwix provider: intercepts the products (`lax.dot_general`, `jnp.einsum` of two
  operands, `jnp.dot`), the ops on weights and the lookups (`tracking`), and the decoder's
  hooks (`model_hooks`), and hands each to the policy `make_policy` makes; starts a run per
  model call; reports what each intercepted op did (`report()`) and warns once, after the first
  run, about rules that matched nothing."""

  def __init__(self, rules: Sequence[Q8Rule], *, disable_jit: bool = False):
    rules = [validate_rule(r, provider=type(self).__name__) for r in rules]
    super().__init__(rules, disable_jit=disable_jit)
    self.policy = self.make_policy(provider_rules(self), self.current_rule)
    self._warned_unused = False

  def make_policy(self, rules: Sequence[Q8Rule], current_rule: CurrentRule) -> WeightPolicy:
    """The mode's policy."""
    raise NotImplementedError(f"{type(self).__name__} does not define make_policy")

  def current_rule(self, op: str) -> tuple[Q8Rule | None, str]:
    """The rule matching the op being intercepted (op name `op`) and its op id."""
    return current_rule_and_op_id(self, op)

  def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
    """The base provider's interceptions, the products, the ops on weights and the lookups,
    and the decoder's hooks."""
    policy = self.policy
    weights = tracking.intercepts(lambda: policy.run, policy.lookup, policy.q8_lookup)
    return self.base_intercepts() | self.product_intercepts() | weights | model_hooks.intercepts()

  def base_intercepts(self) -> dict[str, Callable[..., Any]]:
    """The interceptions of the Qwix provider this class is mixed into."""
    return super().get_intercept_map()

  def process_model_inputs(self, model: Any, model_args: Any, model_kwargs: Any) -> Any:
    self.policy.start_run()  # a run starts: nothing carried over from the last one
    self.policy.inventory.take_model(model, model_args)
    return super().process_model_inputs(model, model_args, model_kwargs)

  def process_model_output(self, method_name: str, model_output: Any) -> Any:
    self.policy.start_run()  # let go of the run's arrays
    out = super().process_model_output(method_name, model_output)
    if not self._warned_unused:
      self._warned_unused = True
      for rule in self.get_unused_rules():
        warnings.warn(f"Q8 rule matched nothing: {describe(rule)}", stacklevel=2)
      self._warn_served_nothing()
    return out

  def _warn_served_nothing(self) -> None:
    """Warn once for each module where a rule matched an op but none of the module's own
    weights was served, naming them and why each stayed float (weights the rule keeps float on
    purpose, `keep_float`, are in the report only)."""
    inventory = self.policy.inventory
    left = {p.path: p for p in self.policy.float_params()}
    for i, modules in sorted(self.policy.matched_modules().items()):
      for module in sorted(modules):
        mine = [w for w, (m, _) in inventory.params.items() if m == module]
        if not mine or any(w in inventory.served for w in mine):
          continue
        named = [left[w] for w in mine if w in left and not left[w].reason.startswith(KEPT)]
        if named:
          warnings.warn(
            f"{describe(self.policy.rules[i])} matched {module or '(top module)'} but served none"
            " of its weights: " + "; ".join(f"{p.path} {p.shape}: {p.reason}" for p in named),
            stacklevel=3,
          )

  def report(self) -> Report:
    """Every op intercepted so far (the latest trace of each) and the rules that matched nothing."""
    unused = list(self.get_unused_rules()) if initial_run_complete(self) else []
    ops = list(self.policy.records.values())
    return Report(ops=ops, unused_rules=unused, float_params=self.policy.float_params())


__all__ = [
  "CurrentRule",
  "PolicyProvider",
  "RunOn",
  "WeightPolicy",
  "base_layout",
  "op_where",
  "stored_how",
  "weight_note",
]
