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
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules._qwix import (
  current_module_path,
  current_rule_and_op_id,
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
  from_dot_general,
  from_einsum,
)
from q8rules.providers import lookup, model_hooks, tracking, views
from q8rules.providers.placement import annotation, stored_layout
from q8rules.providers.q8_weight import Q8Weight
from q8rules.providers.tracking import Derived, RunState
from q8rules.report import OpRecord, Report
from q8rules.rules import Q8Rule, describe, validate_rule

RunOn = Callable[[Any], jax.Array]
"""`run_on(table)`: the model's own lookup op with `table` for the param's value."""

CurrentRule = Callable[[str], tuple[Q8Rule | None, str]]
"""op name ('dot_general', 'einsum', 'take') -> (the rule matching the op being intercepted,
or None; its op id, e.g. 'dot_general0')."""


def op_where(op_id: str) -> str:
  """'module/path/op_id', how error messages name an op."""
  return f"{current_module_path() or '(top module)'}/{op_id}"


@dataclasses.dataclass(frozen=True)
class Product:
  """One intercepted two-operand product, `lhs` times the (weight) operand `rhs`.

  Attributes:
    rule, op_id: the matched rule (None: none) and the op's id, e.g. 'dot_general0'.
    lhs: the activation as the op got it (any rank).
    rhs: the other operand as the op got it (a float param, a Qwix `WithAux`, or an array).
    make_layout: the weight's shape -> the product's layout (raises `UnsupportedProduct`).
    precision, preferred_element_type: the op's own.
    run: `run(lhs, weight, precision)`, the op itself on `lhs` with `weight` for `rhs` (in
      float); it closes over no array, so it can run on other operands (a tangent).
  """

  rule: Q8Rule | None
  op_id: str
  lhs: jax.Array
  rhs: Any
  make_layout: Callable[[tuple[int, ...]], ProductLayout]
  precision: Any
  preferred_element_type: Any
  run: Callable[[Any, Any, Any], jax.Array]


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
  """

  def __init__(self, rules: Sequence[Q8Rule], current_rule: CurrentRule):
    self.rules = list(rules)
    self.current_rule = current_rule
    self.run = RunState()
    self.records: dict[tuple[str, str], OpRecord] = {}

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
    self.records[(module, op_id)] = OpRecord(module, op_id, index, path, **fields)

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
    if found is None:  # Qwix's own search: through any unary op when traced, or by shape
      name = find_param(rhs)
      if not name:
        return None, "operand is not a weight"
      module = get_current_module()
      param = unbox(module_params(module)[name])
      if tuple(param.shape) != tuple(rhs.shape):  # eagerly it would not be found: the same here
        return None, (
          f"derives from {name} through an op q8rules does not carry (astype, .T, transpose,"
          " reshape and Flax's dtype promotion are carried): left float"
        )
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
    try:
      layout = product.make_layout(tuple(rhs.shape))
    except UnsupportedProduct as e:
      warnings.warn(f"{op_where(op_id)}: left float: {e}", stacklevel=5)
      self.record(rule, op_id, "float", note=f"left float: {e}")
      return None
    if not jnp.issubdtype(rhs.dtype, jnp.floating):
      raise TypeError(
        f"{op_where(op_id)}: weight {found.name!r} has dtype {rhs.dtype}; Q8_0 quantizes float"
        " weights"
      )
    return found, layout

  def lookup_layout(
    self, rule: Q8Rule | None, op_id: str, shape: Any, axis: int
  ) -> WeightLayout | None:
    """The table's lookup layout, or None (recorded float, with a warning) when a lookup in it
    is not served from Q8_0 (`lookup.lookup_layout`: 2-D tables only)."""
    try:
      return lookup.lookup_layout(tuple(shape), axis)
    except lookup.UnsupportedLookup as e:
      warnings.warn(f"{op_where(op_id)}: left float: {e}", stacklevel=5)
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
    self.record(rule, op_id, "float", weight_shape=tuple(arr.shape), note=note)
    return run_on(arr)


class PolicyProvider:
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

  def product_intercepts(self) -> dict[str, Callable[..., Any]]:
    """Qwix name -> the handler of each product this provider intercepts."""
    return {
      "jax.lax.dot_general": self.dot_general,
      "jax.numpy.einsum": self.einsum,
      "jax.numpy.dot": self.dot,
    }

  def process_model_inputs(self, model: Any, model_args: Any, model_kwargs: Any) -> Any:
    self.policy.start_run()  # a run starts: nothing carried over from the last one
    return super().process_model_inputs(model, model_args, model_kwargs)

  def process_model_output(self, method_name: str, model_output: Any) -> Any:
    self.policy.start_run()  # let go of the run's arrays
    out = super().process_model_output(method_name, model_output)
    if not self._warned_unused:
      self._warned_unused = True
      for rule in self.get_unused_rules():
        warnings.warn(f"Q8 rule matched nothing: {describe(rule)}", stacklevel=2)
    return out

  def report(self) -> Report:
    """Every op intercepted so far (the latest trace of each) and the rules that matched nothing."""
    unused = list(self.get_unused_rules()) if initial_run_complete(self) else []
    return Report(ops=list(self.policy.records.values()), unused_rules=unused)

  # ---- the intercepted products ------------------------------------------------

  def dot_general(
    self,
    lhs: jax.Array,
    rhs: Any,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    *,
    out_sharding: Any = None,
  ) -> jax.Array:
    """`lax.dot_general(lhs, rhs, ...)` as the policy serves it."""

    def run(lhs: jax.Array, weight: Any, precision: Any) -> jax.Array:
      return jax.lax.dot_general(
        lhs,
        weight,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
      )

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      return from_dot_general(lhs.ndim, shape, dimension_numbers)

    return self._product(
      "dot_general", lhs, rhs, make_layout, precision, preferred_element_type, run
    )

  def dot(
    self,
    a: jax.Array,
    b: Any,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    out_sharding: Any = None,
  ) -> jax.Array:
    """`jnp.dot(a, b)` as the policy serves it; its rules name it 'dot_general'."""

    def run(a: jax.Array, weight: Any, precision: Any) -> jax.Array:
      return jnp.dot(
        a,
        weight,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
      )

    dims = jnp_dot_dimension_numbers(np.ndim(a), len(b.shape))

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      return from_dot_general(np.ndim(a), shape, dims)

    return self._product("dot_general", a, b, make_layout, precision, preferred_element_type, run)

  def einsum(
    self,
    einsum_str: str,
    *operands: Any,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    _dot_general: Callable[..., jax.Array] = jax.lax.dot_general,  # noqa: N803 (jnp's name)
    out_sharding: Any = None,
  ) -> jax.Array:
    """`jnp.einsum` of two operands (the second the weight) as the policy serves it; of other
    counts, in float (recorded)."""

    def run(*ops: Any, precision: Any = precision) -> jax.Array:
      return jnp.einsum(
        einsum_str,
        *ops,
        precision=precision,
        preferred_element_type=preferred_element_type,
        _dot_general=_dot_general,
        out_sharding=out_sharding,
      )

    if len(operands) != 2:
      rule, op_id = self.current_rule("einsum")
      self.policy.record(rule, op_id, "float", note=f"{len(operands)}-operand einsum")
      return run(*operands)
    lhs, rhs = operands

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      return from_einsum(einsum_str, lhs.ndim, shape)

    return self._product(
      "einsum",
      lhs,
      rhs,
      make_layout,
      precision,
      preferred_element_type,
      lambda lhs, weight, precision: run(lhs, weight, precision=precision),
    )

  def _product(
    self,
    op: str,
    lhs: jax.Array,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
    precision: Any,
    preferred_element_type: Any,
    run: Callable[[Any, Any, Any], jax.Array],
  ) -> jax.Array:
    """The policy's answer to the product the op `op` ('dot_general', 'einsum': how rules name
    it) runs."""
    rule, op_id = self.current_rule(op)
    return self.policy.product(
      Product(rule, op_id, lhs, rhs, make_layout, precision, preferred_element_type, run)
    )


def jnp_dot_dimension_numbers(a_ndim: int, b_ndim: int) -> jax.lax.DotDimensionNumbers:
  """The `lax.dot_general` dimension numbers of `jnp.dot(a, b)`."""
  if a_ndim == 0 or b_ndim == 0:
    contract = ((), ())
  elif b_ndim == 1:
    contract = ((a_ndim - 1,), (0,))
  else:
    contract = ((a_ndim - 1,), (b_ndim - 2,))
  return (contract, ((), ()))


__all__ = [
  "CurrentRule",
  "PolicyProvider",
  "Product",
  "RunOn",
  "WeightPolicy",
  "base_layout",
  "jnp_dot_dimension_numbers",
  "op_where",
  "stored_how",
  "weight_note",
]
