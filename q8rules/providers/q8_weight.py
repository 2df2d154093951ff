"""`Q8Weight`: a Q8_0 param that a model can use the way it used its float weight.

Qwix keeps a quantized param as `WithAux(array, how)`. `Q8Weight` is that
container (a subclass, so everything that takes a `WithAux` takes it) with the
float weight's face: `shape`, `ndim` and `dtype` are the float weight's, and the
ops a model applies to a weight before its product are carried onto the same
int8 values and scales (`q8rules.providers.views`):

  * `w.T`, `w.transpose(...)`, `w.astype(dtype)`, `w.reshape(...)` (keeping K and
    N) give a view: the same `Q8Array`, its `how` describing the view's layout;
  * `w[ids]` / `w[(ids,)]` / `jnp.take(w, ids, axis)` on an embedding table
    gather the looked-up columns of the (K, N) matrix and dequantise only them
    (`q8rules.providers.lookup.take_q8`): the table is stored once, for lookups and a
    tied head alike;
  * `w[i]` on a stack of experts gives expert i's matrix, read in place;
  * `w * c`, `c * w`, `w / c` with a number, or a float array constant along the product's
    contracted axes (a factor per output column, per expert of a stack), give a view whose
    products take the factor on their output (`views.Scale`, `views.ColumnScale`).

Anything else (other arithmetic, other jnp functions, slicing) raises a `TypeError`
naming the param, never an error from deep inside JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from q8rules._qwix import WithAux, unbox
from q8rules.kernels.layer import LayerSlice
from q8rules.layout import ProductLayout, Q8How, UnsupportedProduct
from q8rules.providers import views
from q8rules.providers.lookup import (
  UnsupportedLookup,
  check_lookup_kwargs,
  indexing_ids,
  lookup_layout,
  take_q8,
)
from q8rules.q8_0 import Q8Array, quantize

SERVED_OPS = (
  "products (lax.dot_general, jnp.dot, jnp.einsum, lax.ragged_dot), lookups (table[ids],"
  " jnp.take), .T / transpose, astype and reshapes that keep K and N, w[i] of a stack of"
  " experts, factors along N (w * c, w / c)"
)
"""What a Q8_0 weight can be used for (error messages)."""


@flax.struct.dataclass
class Q8Weight(WithAux):
  """`WithAux(Q8Array (K_padded, N), Q8How)` with the float weight's face (see the module).

  Attributes:
    array: the Q8_0 values and scales, (K_padded, N).
    how: the layout and dtypes of the weight as the model sees it: the param's own for a
      stored param, the view's for `chain` applied to it.
    name: the param's path ('embedder/input_embedding'), for error messages and reports.
    chain: the ops that made this view from the stored param (empty for the param itself).
  """

  name: str = flax.struct.field(pytree_node=False, default="")
  chain: views.Chain = flax.struct.field(pytree_node=False, default=())

  # ---- the float weight's face ---------------------------------------------

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.how.layout.shape)

  @property
  def ndim(self) -> int:
    return len(self.how.layout.shape)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.how.dtype)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  def __len__(self) -> int:
    return self.shape[0]

  # ---- views ----------------------------------------------------------------

  def view(self, op: views.Op) -> Q8Weight:
    """The view `op(w)`: the same Q8 values, laid out as `op` leaves the float weight."""
    try:
      layout = op.forward(self.how.layout)
      if isinstance(op, views.ColumnScale):  # its factor on the matrix's columns
        op = op.placed(self.how.layout)
    except views.ViewError as e:
      raise TypeError(f"{self.what()}: {e}") from None
    dtype = op.dtype if isinstance(op, views.AsType) else self.how.dtype
    array, chain = self.array, self.chain
    if isinstance(op, views.Index):  # one expert of the stack, read in place by the kernels
      stacked = dataclasses.replace(array, axis=array.axis - 1)
      array = LayerSlice(stacked, jnp.asarray(op.index, jnp.int32))
      chain = tuple(o.indexed(op.index) if isinstance(o, views.ColumnScale) else o for o in chain)
    how = Q8How(layout, self.how.scale_dtype, dtype)
    return self.replace(array=array, how=how, chain=chain + (op,))

  @property
  def T(self) -> Q8Weight:  # noqa: N802 (numpy's name)
    return self.view(views.Transpose(tuple(reversed(range(self.ndim)))))

  def transpose(self, *axes: Any) -> Q8Weight:
    if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], Sequence)):
      axes = axes[0]
    perm = tuple(reversed(range(self.ndim))) if not axes else tuple(int(a) for a in axes)
    return self.view(views.Transpose(tuple(a % self.ndim for a in perm)))

  def astype(self, dtype: Any) -> Q8Weight:
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{self.what()}: astype({dtype}) is not served (float dtypes only)")
    if dtype == self.dtype:  # as jnp.astype: the same dtype is the same array
      return self
    return self.view(views.AsType(dtype.name))

  def __mul__(self, other: Any) -> Q8Weight:
    return self.view(_factor(other, self, "*", divide=False))

  __rmul__ = __mul__

  def __truediv__(self, other: Any) -> Q8Weight:
    return self.view(_factor(other, self, "/", divide=True))

  def reshape(self, *shape: Any) -> Q8Weight:
    if len(shape) == 1 and isinstance(shape[0], Sequence):
      shape = tuple(shape[0])
    shape = tuple(int(s) for s in shape)
    if -1 in shape:
      known = int(np.prod([s for s in shape if s != -1]))
      shape = tuple(self.size // known if s == -1 else s for s in shape)
    return self.view(views.Reshape(shape))

  # ---- lookups --------------------------------------------------------------

  def __getitem__(self, idx: Any) -> Any:
    if isinstance(idx, tuple) and len(idx) == 1:
      idx = idx[0]
    if idx is Ellipsis:  # `param[...]`: the whole value (how nnx modules read a param)
      return unbox(self)
    if isinstance(idx, int | np.integer) and self.how.layout.batch[:1] == (0,):
      return self.view(views.Index(int(idx) % self.shape[0]))  # an expert of the stack
    if not is_index_array(idx):
      raise TypeError(
        f"{self.what()}: indexing with {idx!r} is not served; a Q8_0 table serves"
        f" lookups table[ids] with integer ids (served: {SERVED_OPS})"
      )
    return lookup(self, indexing_ids(idx, self.shape[0]), 0, "clip")

  def check_take(self, indices: Any, axis: Any, options: dict[str, Any]) -> None:
    """Refuse, naming the param, a `jnp.take` that is not a lookup the Q8_0 values serve."""
    if axis is None or not is_index_array(indices):
      raise TypeError(
        f"{self.what()}: take(axis={axis}) is not served; a Q8_0 table serves"
        f" jnp.take(table, ids, axis=...) with integer ids and an axis"
      )
    try:
      check_lookup_kwargs(options)
    except UnsupportedLookup as e:
      raise TypeError(f"{self.what()}: {e}") from None

  def take(self, indices: Any, axis: int | None = None, **kwargs: Any) -> jax.Array:
    """`jnp.take(w, indices, axis, mode=...)` (lookups only: integer ids and an axis)."""
    self.check_take(indices, axis, kwargs)
    return lookup(self, indices, axis, kwargs.get("mode"))

  # ---- everything else: a clear error ----------------------------------------

  def what(self) -> str:
    """How errors name this weight: its param and float shape, and the view it is."""
    view = f" (as {views.describe(self.chain)})" if self.chain else ""
    return f"Q8_0 weight {self.name or '(unnamed)'} of float shape {self.shape}{view}"

  def refuse(self, op: str) -> TypeError:
    return TypeError(f"{self.what()}: {op} is not served for a Q8_0 weight (served: {SERVED_OPS})")

  def __jax_array__(self) -> jax.Array:
    raise self.refuse("converting it to an array (a jnp function or an operator on it)")

  def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
    raise self.refuse("converting it to a numpy array")


def _refusing(op: str) -> Any:
  def method(self: Q8Weight, *args: Any, **kwargs: Any) -> Any:
    raise self.refuse(f"the operator {op}")

  return method


for _name, _op in {
  "__add__": "+",
  "__radd__": "+",
  "__sub__": "-",
  "__rsub__": "-",
  "__rtruediv__": "/",
  "__matmul__": "@",
  "__rmatmul__": "@",
  "__neg__": "unary -",
  "__pow__": "**",
}.items():
  setattr(Q8Weight, _name, _refusing(_op))


def _factor(other: Any, weight: Q8Weight, op: str, divide: bool) -> views.Scale | views.ColumnScale:
  """`other` as the factor of `weight {op} other`: a number (`Scale`) or a float array
  (`ColumnScale`, checked against the weight's layout when the view is taken); a TypeError,
  naming the weight, for anything else."""
  factor = views.factor_op(other, divide)
  if factor is None:
    raise weight.refuse(
      f"the operator {op} with {type(other).__name__} (a number, or a float array along the"
      " output columns, is served)"
    )
  return factor


def is_index_array(idx: Any) -> bool:
  """Whether `idx` is an integer array or int (what an embedding lookup takes)."""
  if isinstance(idx, bool | np.bool_):
    return False
  if isinstance(idx, int | np.integer):
    return True
  dtype = getattr(idx, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.integer)


def as_q8_weight(x: Any, name: str = "") -> Q8Weight | None:
  """`x` (boxed or not) as a `Q8Weight` when it is a Q8 param (a plain Qwix `WithAux` made by
  other code included), else None."""
  x = unbox(x)
  if isinstance(x, Q8Weight):
    return x
  if isinstance(x, WithAux) and isinstance(x.how, Q8How) and isinstance(x.array, Q8Array):
    return Q8Weight(array=x.array, how=x.how, name=name)
  return None


def lookup(table: Q8Weight, ids: Any, axis: int, mode: str | None = None) -> jax.Array:
  """`jnp.take(w, ids, axis, mode=mode)` of the float weight, from its Q8_0 storage
  (`q8rules.providers.lookup.take_q8`: the looked-up columns of the (K, N) matrix, dequantised).

  The table must be stored (or viewed) as `lookup_layout` says: 2-D, the looked-up axis N
  (an embedding table (V, D) used by a tied head `x @ E.T` is stored with K = D, N = V).

  Raises:
    TypeError: naming the param, for any other lookup.
  """
  table = unbox(table)
  have = table.how.layout
  try:
    layout = lookup_layout(have.shape, axis)
    if layout != have:
      raise UnsupportedLookup(
        f"a lookup along axis {axis} needs that axis alone in N; this weight is laid out with"
        f" axes {have.free} in N (K: {have.contract})"
      )
  except UnsupportedLookup as e:
    raise TypeError(f"{table.what()}: {e}") from None
  return take_q8(unbox(table.array), layout, ids, table.how.dtype, mode)


def quantize_weight(
  w: jax.Array, how: Q8How, *, name: str = "weight", check_finite: bool = True
) -> Q8Array:
  """The float weight (how.layout.shape) as a (K_padded, N) Q8Array blocked along axis 0, or,
  for a stack of experts (`how.layout.batch`), a (*E, K_padded, N) Q8Array blocked along each
  expert's K.

  `check_finite=False` where the caller has already checked `w` (see `quantize`)."""
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"{name}: cannot quantize a weight of dtype {w.dtype} to Q8_0 (not float)")
  if tuple(w.shape) != how.layout.shape:
    raise ValueError(
      f"{name}: weight of shape {tuple(w.shape)} does not match its Q8 params, which"
      f" were made for shape {how.layout.shape}"
    )
  return dataclasses.replace(
    quantize(
      how.layout.to_matrix(w),
      axis=how.layout.blocked_axis,
      scale_dtype=how.scale_dtype,
      name=name,
      check_finite=check_finite,
    ),
    dtype=np.dtype(how.dtype),
  )


def served_layout(
  q8: WithAux, make_layout: Callable[[tuple[int, ...]], ProductLayout], where: str
) -> ProductLayout:
  """The layout of a product on the Q8 weight `q8`, conformed to how the weight is laid out
  (`make_layout`: the weight's shape -> the op's layout). Raises ValueError, naming the op,
  when the weight cannot serve the product."""
  how = q8.how
  try:
    layout = views.conform(make_layout(how.layout.shape), how.layout)
  except UnsupportedProduct as e:
    raise ValueError(f"{where}: Q8 weight used by a product it cannot serve: {e}") from e
  if layout is None:
    wanted = make_layout(how.layout.shape).weight
    problem = f"the Q8 weight was laid out as {how.layout} but this product needs {wanted}"
  elif tuple(q8.array.shape) != layout.weight.stored_shape:
    want = layout.weight.stored_shape
    problem = f"Q8 values of shape {tuple(q8.array.shape)} do not match the weight layout {want}"
  else:
    return layout
  raise ValueError(f"{where}: {problem}")


__all__ = [
  "SERVED_OPS",
  "Q8Weight",
  "as_q8_weight",
  "is_index_array",
  "lookup",
  "quantize_weight",
  "served_layout",
]
