"""Array ops a model applies to a weight before its product, carried onto its (K, N) layout.

A model may hand a product not its param `w` but `w.T`, `w.astype(dtype)` or
`w.reshape(shape)` (Tunix's Qwen casts every weight; a tied head is `x @ E.T`).
None of these changes the Q8_0 matrix: the same int8 values and scales serve
the view, under a different `WeightLayout` (where the view's axes go in K and
N). An `Op` maps a layout forward (param -> view: serving a Q8 param through the
op) and an array forward (QAT: the op applied to the fake-quantised param), and
`base_layout` maps the layout the product needs back onto the param (which is
what gets quantized, in its own shape and dtype: never the derived copy).

A reshape is carried when it keeps K and N: the matrix must be the row-major
(K, N) or (N, K) reading of both shapes. Any other reshape raises `ViewError`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.layout import ProductLayout, WeightLayout


class ViewError(ValueError):
  """An op on a weight that its Q8_0 matrix cannot serve (the message names the op)."""


def _prefix_with_product(shape: tuple[int, ...], size: int) -> int | None:
  """The shortest length p with prod(shape[:p]) == size (p >= 1), or None."""
  prod = 1
  for p, s in enumerate(shape, start=1):
    prod *= s
    if prod == size:
      return p
    if prod > size and size > 0:
      return None
  return None


def reshaped(layout: WeightLayout, shape: Sequence[int]) -> WeightLayout:
  """The layout of `w.reshape(shape)` with the same (K, N) matrix (or stack of them) as `w` of
  `layout`. Batch (expert) axes must lead and be kept as they are.

  Raises:
    ViewError: the reshape does not keep K and N (the matrix would change), or moves a batch
      axis.
  """
  shape = tuple(int(s) for s in shape)
  if math.prod(shape) != math.prod(layout.shape):
    raise ViewError(f"reshape {layout.shape} -> {shape} changes the number of elements")
  nb = len(layout.batch)
  if nb:
    if layout.batch != tuple(range(nb)) or shape[:nb] != layout.shape[:nb]:
      raise ViewError(
        f"reshape {layout.shape} -> {shape} does not keep the leading expert axes"
        f" {layout.batch} as they are"
      )
    inner = reshaped(layout.matrix(), shape[nb:])
    return WeightLayout(
      shape,
      tuple(a + nb for a in inner.contract),
      tuple(a + nb for a in inner.free),
      layout.batch,
    )
  n_axes = len(layout.shape)
  order = layout.contract + layout.free
  if order == tuple(range(n_axes)):  # row-major (K, N)
    p = _prefix_with_product(shape, layout.k)
    if p is not None and (p < len(shape) or layout.n == 1):
      return WeightLayout(shape, tuple(range(p)), tuple(range(p, len(shape))))
  elif layout.free + layout.contract == tuple(range(n_axes)):  # row-major (N, K)
    p = _prefix_with_product(shape, layout.n)
    if p is not None and p < len(shape):
      return WeightLayout(shape, tuple(range(p, len(shape))), tuple(range(p)))
  raise ViewError(
    f"reshape {layout.shape} -> {shape} does not keep the Q8_0 matrix (K={layout.k},"
    f" N={layout.n}: contraction axes {layout.contract}, other axes {layout.free})"
  )


def transposed(layout: WeightLayout, perm: Sequence[int]) -> WeightLayout:
  """The layout of `jnp.transpose(w, perm)` (view axis i is axis perm[i] of w)."""
  perm = tuple(int(p) for p in perm)
  if sorted(perm) != list(range(len(layout.shape))):
    raise ViewError(f"transpose axes {perm} are not a permutation of {len(layout.shape)} axes")
  return WeightLayout(
    tuple(layout.shape[p] for p in perm),
    tuple(perm.index(a) for a in layout.contract),
    tuple(perm.index(a) for a in layout.free),
    tuple(perm.index(a) for a in layout.batch),
  )


@dataclasses.dataclass(frozen=True)
class Transpose:
  """`jnp.transpose(w, perm)` (`w.T` is the reversed axes)."""

  perm: tuple[int, ...]

  def forward(self, layout: WeightLayout) -> WeightLayout:
    return transposed(layout, self.perm)

  def backward(self, layout: WeightLayout, base_shape: tuple[int, ...]) -> WeightLayout:
    return transposed(layout, tuple(int(i) for i in np.argsort(self.perm)))

  def array(self, w: jax.Array) -> jax.Array:
    return jnp.transpose(w, self.perm)

  def __str__(self) -> str:
    return f"transpose{self.perm}"


@dataclasses.dataclass(frozen=True)
class Reshape:
  """`w.reshape(shape)`, carried when it keeps K and N (see `reshaped`)."""

  shape: tuple[int, ...]

  def forward(self, layout: WeightLayout) -> WeightLayout:
    return reshaped(layout, self.shape)

  def backward(self, layout: WeightLayout, base_shape: tuple[int, ...]) -> WeightLayout:
    return reshaped(layout, base_shape)

  def array(self, w: jax.Array) -> jax.Array:
    return jnp.reshape(w, self.shape)

  def __str__(self) -> str:
    return f"reshape{self.shape}"


@dataclasses.dataclass(frozen=True)
class AsType:
  """`w.astype(dtype)`: the layout is unchanged; values come back in `dtype`."""

  dtype: str

  def forward(self, layout: WeightLayout) -> WeightLayout:
    return layout

  def backward(self, layout: WeightLayout, base_shape: tuple[int, ...]) -> WeightLayout:
    return layout

  def array(self, w: jax.Array) -> jax.Array:
    return w.astype(self.dtype)

  def __str__(self) -> str:
    return f"astype({self.dtype})"


@dataclasses.dataclass(frozen=True)
class Index:
  """`w[i]` on a stack of experts (E, ...): expert i's own matrix (`index`, a Python int); the
  stack's leading axis must be a batch axis."""

  index: int

  def forward(self, layout: WeightLayout) -> WeightLayout:
    if layout.batch[:1] != (0,):
      raise ViewError(
        f"w[i] of a weight {layout.shape} whose leading axis is not a stack of experts"
        f" (contraction axes {layout.contract}, other axes {layout.free})"
      )
    drop = lambda axes: tuple(a - 1 for a in axes)  # noqa: E731
    return WeightLayout(
      layout.shape[1:], drop(layout.contract), drop(layout.free), drop(layout.batch[1:])
    )

  def backward(self, layout: WeightLayout, base_shape: tuple[int, ...]) -> WeightLayout:
    lift = lambda axes: tuple(a + 1 for a in axes)  # noqa: E731
    return WeightLayout(
      (int(base_shape[0]), *layout.shape),
      lift(layout.contract),
      lift(layout.free),
      (0, *lift(layout.batch)),
    )

  def array(self, w: jax.Array) -> jax.Array:
    return w[self.index]

  def __str__(self) -> str:
    return f"[{self.index}]"


class Factor:
  """What `Scale` and `ColumnScale` share: a factor on the weight's values (`w * factor`, or
  `w / factor` with `divide`) that leaves its layout as it is."""

  factor: Any
  divide: bool

  def forward(self, layout: WeightLayout) -> WeightLayout:
    return layout

  def backward(self, layout: WeightLayout, base_shape: tuple[int, ...]) -> WeightLayout:
    return layout

  def array(self, w: jax.Array) -> jax.Array:
    return w / self.factor if self.divide else w * self.factor


@dataclasses.dataclass(frozen=True)
class Scale(Factor):
  """`w * factor` (`factor * w`), or `w / factor` with `divide`: a constant factor (a Python
  number) on the weight. The Q8_0 values stay those of `w`; the product's output takes the
  factor (`scale_output`), as x @ (w * c) = (x @ w) * c."""

  factor: float
  divide: bool = False

  def __str__(self) -> str:
    return f"{'/' if self.divide else '*'} {self.factor:g}"


@dataclasses.dataclass(frozen=True, eq=False)
class ColumnScale(Factor):
  """`w * c` (`c * w`), or `w / c` with `divide`: an array factor `c` that broadcasts against
  the weight without changing its shape and is constant along the product's contracted axes
  (one factor per column of the Q8_0 matrix, and per expert of a stack: a vector along N).
  The Q8_0 values stay those of `w`; the product's output takes the factor column by column
  (`scale_output`), as x @ (w * c) = (x @ w) * c.

  Attributes:
    factor: the array the model multiplied by (any float dtype; may be traced).
    divide: `w / c`.
    columns: the factor on the columns of the Q8_0 matrix, (*batch_shape, N) float32, in the
      order of the weight's N (`placed`, when a Q8 weight takes the view); None before.
  """

  factor: Any
  divide: bool = False
  columns: Any = None

  def placed(self, layout: WeightLayout) -> ColumnScale:
    """This factor on the columns of a weight of `layout` (`columns`).

    Raises:
      ViewError: the factor would change the weight's shape, or varies along its contracted
        axes (K: no output column takes it).
    """
    c = jnp.asarray(self.factor)
    shape, given = layout.shape, tuple(c.shape)
    if c.ndim > len(shape):
      raise ViewError(f"a factor of shape {given} has more axes than the weight {shape}")
    c = c.reshape((1,) * (len(shape) - c.ndim) + given)
    if any(c.shape[a] not in (1, shape[a]) for a in range(len(shape))):
      raise ViewError(f"a factor of shape {given} does not broadcast against the weight {shape}")
    along_k = tuple(a for a in layout.contract if c.shape[a] != 1)
    if along_k:
      raise ViewError(
        f"a factor of shape {given} varies along the weight's contracted axes {along_k} (K);"
        " served: a factor per output column (along N) or per expert, constant along K"
      )
    c = jnp.transpose(c, layout.batch + layout.contract + layout.free)
    free = tuple(shape[a] for a in layout.free)
    c = jnp.broadcast_to(c, (*layout.batch_shape, *(1,) * len(layout.contract), *free))
    return dataclasses.replace(
      self, columns=c.reshape(*layout.batch_shape, layout.n).astype(jnp.float32)
    )

  def indexed(self, index: int) -> ColumnScale:
    """The factor of expert `index` of a stack (`Index`), once placed."""
    if self.columns is None:
      return self
    return dataclasses.replace(self, columns=self.columns[index])

  def __str__(self) -> str:
    return f"{'/' if self.divide else '*'} array{tuple(jnp.shape(self.factor))}"


Op = Transpose | Reshape | AsType | Index | Scale | ColumnScale

FACTORS = (Scale, ColumnScale)
"""The ops that put a factor on a weight (the product's output takes it): `Factor`'s kinds."""


def factor_op(factor: Any, divide: bool) -> Scale | ColumnScale | None:
  """The op of `w * factor` (`w / factor` when `divide`): `Scale` for a Python or numpy number,
  `ColumnScale` for a float array (jax or numpy); None for anything else."""
  if isinstance(factor, bool | np.bool_):
    return None
  if isinstance(factor, int | float | np.integer | np.floating):
    return Scale(float(factor), divide)
  if isinstance(factor, jax.Array | np.ndarray) and jnp.issubdtype(factor.dtype, jnp.floating):
    return ColumnScale(factor, divide)
  return None


def _output_factor(
  columns: jax.Array, layout: ProductLayout, group_sizes: jax.Array | None, rows: int
) -> jax.Array:
  """`columns` (*batch_shape, N) laid out against the product's output: per row's expert for a
  grouped product (`rows` rows, `group_sizes`), per expert for a batched one."""
  if group_sizes is not None:  # rows sorted by expert: each row takes its expert's factors
    experts = columns.shape[0]
    row_expert = jnp.repeat(jnp.arange(experts), group_sizes, total_repeat_length=rows).clip(
      0, experts - 1
    )
    return columns[row_expert]  # a grouped product's output is (rows, N)
  weight = layout.weight
  lead = weight.batch_shape if layout.batched else ()
  free = tuple(weight.shape[a] for a in weight.free)
  f = columns.reshape(*lead, *(1,) * len(layout.lhs_free), *free)
  return jnp.transpose(f, layout.out_perm)


def scale_output(
  y: jax.Array, chain: Chain, layout: ProductLayout, group_sizes: jax.Array | None = None
) -> jax.Array:
  """A product's output `y` (float32, the op's output shape) times the factors of `chain` (a Q8
  weight's view), in its order; `layout`: the product's, conformed to the weight's;
  `group_sizes`: a grouped product's."""
  for op in chain:
    if isinstance(op, Scale):
      y = op.array(y).astype(y.dtype)
    elif isinstance(op, ColumnScale):
      f = _output_factor(op.columns, layout, group_sizes, y.shape[0])
      y = (y / f if op.divide else y * f).astype(y.dtype)
  return y


Chain = tuple[Op, ...]


def base_layout(
  view: WeightLayout, chain: Chain, shapes: Sequence[tuple[int, ...]]
) -> WeightLayout:
  """The layout of the param that the view `chain(param)` of layout `view` reads the same
  (K, N) matrix from. `shapes[i]` is the shape the i-th op of the chain was applied to."""
  layout = view
  for op, shape in zip(reversed(chain), reversed(tuple(shapes)), strict=True):
    layout = op.backward(layout, tuple(shape))
  if shapes and tuple(layout.shape) != tuple(shapes[0]):
    raise ViewError(f"the ops {describe(chain)} do not lead back to the param's shape")
  return layout


def forward_layout(layout: WeightLayout, chain: Chain) -> WeightLayout:
  """The layout of `chain(param)` for a param of `layout`."""
  for op in chain:
    layout = op.forward(layout)
  return layout


def apply(chain: Chain, w: jax.Array) -> jax.Array:
  """`chain` applied to the array `w` (what the model computed from its param)."""
  for op in chain:
    w = op.array(w)
  return w


def describe(chain: Chain) -> str:
  return " -> ".join(map(str, chain)) or "(none)"


def conform(product: ProductLayout, stored: WeightLayout) -> ProductLayout | None:
  """`product` rewritten for a weight laid out as `stored`: the same axes contracted in the same
  order, the other axes flattened into N in `stored`'s order (the output is put back in the
  op's order). None when `stored` contracts other axes or orders K differently."""
  have = product.weight
  if have == stored:
    return product
  if (
    have.shape != stored.shape
    or have.batch != stored.batch
    or have.contract != stored.contract
    or sorted(have.free) != sorted(stored.free)
  ):
    return None
  n_lhs = len(product.lhs_free)
  # symbols: ('b', a) for batch axis a (a batched product's), ('x', i) for lhs_free[i],
  # ('w', a) for weight axis a
  lead = [("b", a) for a in have.batch] if product.batched else []
  before = lead + [("x", i) for i in range(n_lhs)] + [("w", a) for a in have.free]
  after = lead + [("x", i) for i in range(n_lhs)] + [("w", a) for a in stored.free]
  out_order = [before[i] for i in product.out_perm]
  return dataclasses.replace(
    product, weight=stored, out_perm=tuple(after.index(s) for s in out_order)
  )


def free_order_for(layout: WeightLayout, entries: Sequence[Any]) -> WeightLayout:
  """`layout` with the split one of its free axes moved first, so that a PartitionSpec
  (`entries`, one per float axis) splitting it splits a contiguous range of N (Gemma's kv
  einsum (2, heads, D, H) split on heads). Layouts with no such axis come back as they are."""
  split = [a for a in layout.free if a < len(entries) and entries[a] is not None]
  if len(split) != 1:
    return layout
  a = split[0]
  free = (a,) + tuple(b for b in layout.free if b != a)
  return dataclasses.replace(layout, free=free)


__all__ = [
  "FACTORS",
  "Factor",
  "AsType",
  "Chain",
  "ColumnScale",
  "Index",
  "Op",
  "Reshape",
  "Scale",
  "Transpose",
  "ViewError",
  "apply",
  "base_layout",
  "conform",
  "describe",
  "factor_op",
  "forward_layout",
  "free_order_for",
  "reshaped",
  "scale_output",
  "transposed",
]
