"""What the serving and QAT providers share: the intercepted products, finding a matched float
weight, and the op report."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from q8rules._qwix import (
  current_module_path,
  current_rule_and_op_id,
  initial_run_complete,
  provider_rules,
)
from q8rules.layout import ProductLayout, UnsupportedProduct, from_dot_general, from_einsum
from q8rules.providers.policies import operand
from q8rules.providers.tracking import Derived, RunState
from q8rules.report import OpRecord, Report
from q8rules.rules import Q8Rule, describe, validate_rule


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


class RecordingProvider:
  """Mixed into a qwix provider: intercepts `lax.dot_general` and `jnp.einsum` (two operands)
  and hands each product to the provider's `_serve`; records what each intercepted op did,
  for `report()`, and warns once, after the first run, about rules that matched nothing."""

  def __init__(self, rules: Sequence[Q8Rule], *, disable_jit: bool = False):
    rules = [validate_rule(r, provider=type(self).__name__) for r in rules]
    super().__init__(rules, disable_jit=disable_jit)
    self._records: dict[tuple[str, str], OpRecord] = {}
    self._warned_unused = False
    self._run = RunState()  # what this run saw of weights (q8rules.providers.tracking)

  def process_model_inputs(self, model: Any, model_args: Any, model_kwargs: Any) -> Any:
    self._run = RunState()  # a run starts: nothing carried over from the last one
    return super().process_model_inputs(model, model_args, model_kwargs)

  def _record(self, rule: Q8Rule | None, op_id: str, path: str, **fields: Any) -> None:
    module = current_module_path()
    index = None if rule is None else provider_rules(self).index(rule)
    self._records[(module, op_id)] = OpRecord(module, op_id, index, path, **fields)

  def report(self) -> Report:
    """Every op intercepted so far (the latest trace of each) and the rules that matched nothing."""
    unused = list(self.get_unused_rules()) if initial_run_complete(self) else []
    return Report(ops=list(self._records.values()), unused_rules=unused)

  def process_model_output(self, method_name: str, model_output: Any) -> Any:
    self._run = RunState()  # let go of the run's arrays
    out = super().process_model_output(method_name, model_output)
    if not self._warned_unused:
      self._warned_unused = True
      for rule in self.get_unused_rules():
        warnings.warn(f"Q8 rule matched nothing: {describe(rule)}", stacklevel=2)
    return out

  # ---- the intercepted ops -------------------------------------------------

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
    """`lax.dot_general(lhs, rhs, ...)` as the provider serves it."""

    def run(lhs: jax.Array, weight: Any, precision: Any) -> jax.Array:
      return jax.lax.dot_general(
        lhs,
        weight,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
      )

    return self._serve_op(
      "dot_general",
      lhs,
      rhs,
      lambda shape: from_dot_general(lhs.ndim, shape, dimension_numbers),
      precision,
      preferred_element_type,
      run,
    )

  def einsum(
    self,
    einsum_str: str,
    *operands: Any,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    _dot_general: Callable[..., jax.Array] = jax.lax.dot_general,  # noqa: N803 (jnp's name)
    out_sharding: Any = None,
  ) -> jax.Array:
    """`jnp.einsum` of two operands (the second the weight) as the provider serves it; of
    other counts, in float (recorded)."""

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
      rule, op_id = current_rule_and_op_id(self, "einsum")
      self._record(rule, op_id, "float", note=f"{len(operands)}-operand einsum")
      return run(*operands)
    lhs, rhs = operands
    return self._serve_op(
      "einsum",
      lhs,
      rhs,
      lambda shape: from_einsum(einsum_str, lhs.ndim, shape),
      precision,
      preferred_element_type,
      lambda lhs, weight, precision: run(lhs, weight, precision=precision),
    )

  def _serve_op(
    self,
    op: str,
    lhs: jax.Array,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
    precision: Any,
    preferred_element_type: Any,
    run: Callable[[Any, Any, Any], jax.Array],
  ) -> jax.Array:
    """`_serve` of the product the op `op` ('dot_general', 'einsum': how rules name it) runs."""
    rule, op_id = current_rule_and_op_id(self, op)
    return self._serve(
      Product(rule, op_id, lhs, rhs, make_layout, precision, preferred_element_type, run)
    )

  def _serve(self, product: Product) -> jax.Array:
    """The provider's answer to an intercepted product (serving: Q8_0; QAT: fake quant)."""
    raise NotImplementedError(f"{type(self).__name__} does not define _serve")

  def _match_float_weight(
    self,
    rule: Q8Rule | None,
    op_id: str,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
  ) -> tuple[Derived, ProductLayout] | None:
    """The param (`Derived`: also through astype / .T / reshape) and product layout of a float
    weight a rule matched, or None when the op stays float (recorded, with a warning where a
    matched weight cannot be served).

    Raises TypeError on a matched weight that is not float.
    """
    if rule is None:
      self._record(rule, op_id, "float", note="no rule matched")
      return None
    found, why_float = operand(self, rhs)
    if found is None:
      self._record(rule, op_id, "float", note=why_float)
      return None
    name = found.name
    try:
      layout = make_layout(tuple(rhs.shape))
    except UnsupportedProduct as e:
      # the frame that called the intercepted op's handler
      warnings.warn(f"{op_where(op_id)}: left float: {e}", stacklevel=5)
      self._record(rule, op_id, "float", note=f"left float: {e}")
      return None
    if not jnp.issubdtype(rhs.dtype, jnp.floating):
      raise TypeError(
        f"{op_where(op_id)}: weight {name!r} has dtype {rhs.dtype}; Q8_0 quantizes float weights"
      )
    return found, layout


def jnp_dot_dimension_numbers(a_ndim: int, b_ndim: int) -> jax.lax.DotDimensionNumbers:
  """The `lax.dot_general` dimension numbers of `jnp.dot(a, b)`."""
  if a_ndim == 0 or b_ndim == 0:
    contract = ((), ())
  elif b_ndim == 1:
    contract = ((a_ndim - 1,), (0,))
  else:
    contract = ((a_ndim - 1,), (b_ndim - 2,))
  return (contract, ((), ()))
