"""Which param an operand is, through the array ops a model applies to it, during one run.

Qwix finds the param behind an operand by identity, by walking a jit tracer back through
any unary op, or by shape. Only the first is exact: under `jit` the tied head `x @ E.T`
walked back to `E`, and `E.T` was quantized and stored in `E`'s place, while eagerly the
head stayed float. Here the ops a model applies to a weight before its product (`astype`,
`transpose` / `.T`, `reshape`, Flax's `promote_dtype`) are intercepted for the length of a
run: each result that
derives from a param is recorded as `Derived` (the param, its value, the ops), the same
eagerly and traced, so a product can quantize the param itself and serve the view. The same
handlers give a `Q8Weight` its views when a model calls `jnp.astype(w, ...)` and the like
on a Q8 param, and send lookups (`table[ids]`, `jnp.take`) of a param to the provider's
lookup policy (`q8rules.providers.policy.WeightPolicy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from q8rules._qwix import (
  get_attribute,
  get_current_module,
  has_attribute,
  module_params,
  unbox,
)
from q8rules.providers import views
from q8rules.providers.lookup import indexing_ids
from q8rules.providers.q8_weight import Q8Weight, as_q8_weight, is_index_array

ParamKey = tuple[int, str]
"""A param within a run: (id of its module's scope (linen) or module (nnx), name)."""


@dataclasses.dataclass(frozen=True)
class Derived:
  """An array that is a param, or a param after `chain`.

  Attributes:
    module: the module holding the param.
    name: the param's name in it.
    base: the param's (float) value.
    chain: the ops applied to it, in order.
    shapes: the shape each op of `chain` was applied to.
  """

  module: Any
  name: str
  base: jax.Array
  chain: views.Chain = ()
  shapes: tuple[tuple[int, ...], ...] = ()

  @property
  def key(self) -> ParamKey:
    owner = self.module.scope if isinstance(self.module, nn.Module) else self.module
    return (id(owner), self.name)

  def then(self, op: views.Op, shape: tuple[int, ...]) -> Derived:
    return dataclasses.replace(self, chain=self.chain + (op,), shapes=self.shapes + (shape,))


@dataclasses.dataclass
class RunState:
  """What one run (one call of the quantized model, or one trace of it) has seen.

  Attributes:
    derived: id of a derived array -> (its `Derived`, the array, kept so the id stays its own).
    float_lookups: params looked up as float this run (a later product keeps them float).
    weights: params served (or fake-quantised) as Q8_0 weights this run -> their scale dtype.
  """

  derived: dict[int, tuple[Derived, Any]] = dataclasses.field(default_factory=dict)
  float_lookups: set[ParamKey] = dataclasses.field(default_factory=set)
  weights: dict[ParamKey, str] = dataclasses.field(default_factory=dict)

  def find(self, x: Any) -> Derived | None:
    """The param `x` is (or derives from through recorded ops) in the running module, or None."""
    hit = self.derived.get(id(x))
    if hit is not None and hit[1] is x:
      return hit[0]
    if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.floating):
      return None
    try:
      module = get_current_module()
    except ValueError:
      return None
    for name, box in module_params(module).items():
      if unbox(box) is x:
        return Derived(module, name, x)
    return None

  def follow(self, x: Any, out: Any, op: views.Op) -> None:
    """Record `out = op(x)` when `x` is a param or derives from one."""
    if out is x:
      return
    found = self.find(x)
    if found is not None:
      self.derived[id(out)] = (found.then(op, tuple(x.shape)), out)


LookupPolicy = Callable[[Derived, jax.Array, Any, int, Any, Callable[[Any], jax.Array]], jax.Array]
"""(the table param, its value, ids, axis, the `take_q8` mode, `run_on`) -> the looked-up entries.
`run_on(table)` runs the model's own op with `table` for the param's value (float, or QAT's
round trip)."""

Q8Lookup = Callable[[Q8Weight, Any, int, Any], jax.Array]
"""(a Q8 table, ids, axis, the `take_q8` mode) -> the looked-up entries."""

TAKE_OPTIONS = ("out", "mode", "unique_indices", "indices_are_sorted", "fill_value")
"""`jnp.take`'s parameters after `axis`, in order (a caller may pass them positionally)."""


def _lookup_index(idx: Any) -> Any:
  """The ids of `table[idx]` when it is an embedding lookup (`table[ids]`, `table[(ids,)]`)."""
  if isinstance(idx, tuple) and len(idx) == 1:
    idx = idx[0]
  return idx if is_index_array(idx) and not isinstance(idx, int | np.integer) else None


def _expert_index(idx: Any) -> int | None:
  """The expert of `w[i]` when `idx` is one Python or numpy integer (`i`, `(i,)`), else None."""
  if isinstance(idx, tuple) and len(idx) == 1:
    idx = idx[0]
  if isinstance(idx, bool) or not isinstance(idx, int | np.integer):
    return None
  return int(idx)


def intercepts(
  run: Callable[[], RunState],
  float_lookup: LookupPolicy,
  q8_lookup: Q8Lookup,
) -> dict[str, Callable[..., Any]]:
  """The Qwix interceptions for ops on weights, for a provider's `get_intercept_map`.

  Args:
    run: the provider's current `RunState`.
    float_lookup: what a lookup of a float param does (serve it from Q8_0, fake-quantise it,
      or run it float).
    q8_lookup: a lookup of a Q8 param (`q8_weight.lookup`, recorded by the provider): also
      what `w[ids]` on a `Q8Weight` runs.
  """

  def original(name: str) -> Callable[..., Any]:
    return get_attribute(name)  # inside a handler Qwix's interception is off: the original op

  def astype(x: Any, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
    if (q8 := as_q8_weight(x)) is not None:
      return q8.astype(dtype)
    out = original("jax.numpy.astype")(x, dtype, *args, **kwargs)
    run().follow(x, out, views.AsType(np.dtype(out.dtype).name))
    return out

  def transpose(a: Any, axes: Any = None) -> Any:
    if (q8 := as_q8_weight(a)) is not None:
      return q8.transpose(axes)
    out = original("jax.numpy.transpose")(a, axes)
    ndim = np.ndim(a)
    perm = tuple(reversed(range(ndim))) if axes is None else tuple(int(p) % ndim for p in axes)
    run().follow(a, out, views.Transpose(perm))
    return out

  def jnp_reshape(a: Any, *args: Any, **kwargs: Any) -> Any:
    if (q8 := as_q8_weight(a)) is not None:
      shape = kwargs.get("shape", args[0] if args else None)
      if kwargs.get("order", args[1] if len(args) > 1 else "C") != "C":
        raise q8.refuse("a reshape in order other than 'C'")
      return q8.reshape(shape)
    out = original("jax.numpy.reshape")(a, *args, **kwargs)
    if kwargs.get("order", args[1] if len(args) > 1 else "C") == "C":
      run().follow(a, out, views.Reshape(tuple(out.shape)))
    return out

  def lax_reshape(operand: Any, new_sizes: Any, dimensions: Any = None, **kwargs: Any) -> Any:
    in_order = dimensions is None or tuple(dimensions) == tuple(range(len(dimensions)))
    if (q8 := as_q8_weight(operand)) is not None:
      if not in_order:
        raise q8.refuse(f"lax.reshape with dimensions={dimensions}")
      return q8.reshape(tuple(new_sizes))
    out = original("jax.lax.reshape")(operand, new_sizes, dimensions, **kwargs)
    if in_order:
      run().follow(operand, out, views.Reshape(tuple(out.shape)))
    return out

  def take(a: Any, indices: Any, axis: int | None = None, *args: Any, **kwargs: Any) -> Any:
    options = dict(zip(TAKE_OPTIONS, args, strict=False)) | kwargs

    def run_on(table: Any) -> Any:
      return original("jax.numpy.take")(table, indices, axis, **options)

    if (q8 := as_q8_weight(a)) is not None:
      q8.check_take(indices, axis, options)
      return q8_lookup(q8, indices, axis, options.get("mode"))
    # a lookup in a param (of any rank: the policy serves 2-D tables, and records the others
    # float with a warning); other options than `mode` run float
    served = axis is not None and is_index_array(indices) and np.ndim(a) >= 2
    found = run().find(a) if served and not set(options) - {"mode"} else None
    if found is None:
      return run_on(a)
    return float_lookup(found, a, indices, int(axis) % np.ndim(a), options.get("mode"), run_on)

  def rewriting_take(arr: Any, idx: Any, *args: Any, **kwargs: Any) -> Any:
    def run_on(table: Any) -> Any:
      return original("jax._src.numpy.indexing.rewriting_take")(table, idx, *args, **kwargs)

    ids = _lookup_index(idx)
    if (q8 := as_q8_weight(arr)) is not None:
      return q8[idx] if ids is None else q8_lookup(q8, indexing_ids(ids, len(q8)), 0, "clip")
    expert = _expert_index(idx)
    if expert is not None and np.ndim(arr) >= 3:  # w[i]: expert i of a stack (E, K, N)
      out = run_on(arr)
      run().follow(arr, out, views.Index(expert % arr.shape[0]))
      return out
    found = run().find(arr) if ids is not None and np.ndim(arr) == 2 else None
    if found is None:
      return run_on(arr)
    return float_lookup(found, arr, indexing_ids(ids, arr.shape[0]), 0, "clip", run_on)

  def promote_dtype(*args: Any, **kwargs: Any) -> Any:
    """Flax's `promote_dtype` (linen: `*args`; nnx: one sequence), Q8 params passed through."""
    nnx_form = len(args) == 1 and isinstance(args[0], tuple | list)
    values = tuple(args[0]) if nnx_form else args
    floats = [None if as_q8_weight(x) is not None else x for x in values]
    if all(x is None for x in floats):  # only Q8 params (and Nones): nothing to promote
      return args[0] if nnx_form else list(values)
    promoted = original("flax.linen.dtypes.promote_dtype")(*floats, **kwargs)
    out = []
    for x, y in zip(values, promoted, strict=True):
      if y is None:
        out.append(x)
      else:
        run().follow(x, y, views.AsType(np.dtype(y.dtype).name))
        out.append(y)
    return type(args[0])(out) if nnx_form else out

  def scaled(name: str, divide: bool) -> Callable[..., Any]:
    """`w * c`, `c * w` and `w / c` on a param (or a Q8 param), c a number or a float array (a
    factor per output column: `views.ColumnScale`, checked when a product serves it)."""

    def op(self: Any, other: Any) -> Any:
      if not divide and (q8 := as_q8_weight(other)) is not None:  # c * w, c an array
        return q8 * self
      out = original(name)(self, other)
      weight, factor = self, other
      if not divide and run().find(self) is None:  # c * w: the array c's own operator ran
        weight, factor = other, self
      found_op = views.factor_op(factor, divide)
      if found_op is not None:
        run().follow(weight, out, found_op)
      return out

    return op

  handlers = {
    "jax._src.numpy.array_methods._operator_mul": scaled(
      "jax._src.numpy.array_methods._operator_mul", False
    ),
    "jax._src.numpy.array_methods._operator_rmul": scaled(
      "jax._src.numpy.array_methods._operator_rmul", False
    ),
    "jax._src.numpy.array_methods._operator_truediv": scaled(
      "jax._src.numpy.array_methods._operator_truediv", True
    ),
    "flax.linen.dtypes.promote_dtype": promote_dtype,
    "flax.nnx.nn.dtypes.promote_dtype": promote_dtype,
    "jax.numpy.astype": astype,
    "jax.numpy.transpose": transpose,
    "jax.numpy.reshape": jnp_reshape,
    "jax.lax.reshape": lax_reshape,
    "jax.numpy.take": take,
    "jax._src.numpy.indexing.rewriting_take": rewriting_take,
    "q8rules.providers.q8_weight.lookup": q8_lookup,
  }
  # `table[ids]` goes through a private JAX function (jax 0.10): a JAX that moves it leaves
  # float tables' indexing untracked (a Q8 table still serves `w[ids]` itself), not broken.
  return {name: fn for name, fn in handlers.items() if has_attribute(name)}


__all__ = ["Derived", "LookupPolicy", "ParamKey", "Q8Lookup", "RunState", "intercepts"]
