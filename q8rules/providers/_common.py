"""What the serving and QAT providers share: finding a matched float weight, and the op report."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from q8rules._qwix import current_module_path, find_param
from q8rules.layout import ProductLayout, UnsupportedProduct
from q8rules.report import OpRecord, Report
from q8rules.rules import Q8Rule, describe, validate_rule


def op_where(op_id: str) -> str:
  """'module/path/op_id', how error messages name an op."""
  return f"{current_module_path() or '(top module)'}/{op_id}"


class RecordingProvider:
  """Mixed into a qwix provider: records what each intercepted op did, for `report()`,
  and warns once, after the first run, about rules that matched nothing."""

  def __init__(self, rules: Sequence[Q8Rule], *, disable_jit: bool = False):
    rules = [validate_rule(r, provider=type(self).__name__) for r in rules]
    super().__init__(rules, disable_jit=disable_jit)
    self._records: dict[tuple[str, str], OpRecord] = {}
    self._warned_unused = False

  def _record(self, rule: Q8Rule | None, op_id: str, path: str, **fields: Any) -> None:
    module = current_module_path()
    index = None if rule is None else self._rules.index(rule)
    self._records[(module, op_id)] = OpRecord(module, op_id, index, path, **fields)

  def report(self) -> Report:
    """Every op intercepted so far (the latest trace of each) and the rules that matched nothing."""
    unused = list(self.get_unused_rules()) if self._initial_run_complete else []
    return Report(ops=list(self._records.values()), unused_rules=unused)

  def process_model_output(self, method_name: str, model_output: Any) -> Any:
    out = super().process_model_output(method_name, model_output)
    if not self._warned_unused:
      self._warned_unused = True
      for rule in self.get_unused_rules():
        warnings.warn(f"Q8 rule matched nothing: {describe(rule)}", stacklevel=2)
    return out

  def _match_float_weight(
    self,
    rule: Q8Rule | None,
    op_id: str,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
  ) -> tuple[str, ProductLayout] | None:
    """The param name and product layout of a float weight a rule matched, or None when
    the op stays float (recorded, with a warning where a matched weight cannot be served).

    Raises TypeError on a matched weight that is not float.
    """
    if rule is None:
      self._record(rule, op_id, "float", note="no rule matched")
      return None
    name = find_param(rhs)
    if not name:
      self._record(rule, op_id, "float", note="operand is not a weight")
      return None
    try:
      layout = make_layout(tuple(rhs.shape))
    except UnsupportedProduct as e:
      warnings.warn(f"{op_where(op_id)}: left float: {e}", stacklevel=4)
      self._record(rule, op_id, "float", note=f"left float: {e}")
      return None
    if not jnp.issubdtype(rhs.dtype, jnp.floating):
      raise TypeError(
        f"{op_where(op_id)}: weight {name!r} has dtype {rhs.dtype}; Q8_0 quantizes float weights"
      )
    return name, layout


def jnp_dot_dimension_numbers(a_ndim: int, b_ndim: int) -> jax.lax.DotDimensionNumbers:
  """The `lax.dot_general` dimension numbers of `jnp.dot(a, b)`."""
  if a_ndim == 0 or b_ndim == 0:
    contract = ((), ())
  elif b_ndim == 1:
    contract = ((a_ndim - 1,), (0,))
  else:
    contract = ((a_ndim - 1,), (b_ndim - 2,))
  return (contract, ((), ()))
