"""Where a weight's axes go in the 2-D (K, N) Q8_0 layout, and how a product maps onto it.

A weight of any rank is stored as the matrix `(K, N)`: its contraction axes
(the ones the activation is summed against) flattened into K, in the weight's
own axis order, and its other axes flattened into N. K is zero-padded to a
multiple of 32 (zeros quantize to zero blocks, so the product is unchanged).
A Dense kernel `(in, out)` is already `(K, N)`; attention's `'BTD,DNH->BTNH'`
weight `(D, N, H)` becomes `(D, N*H)`; its output `'BTNH,NHD->BTD'` weight
`(N, H, D)` becomes `(N*H, D)`.

`ProductLayout` is the rest of the plan for one product: which activation axes
line up with K (in the same order), and how `(M, N)` is put back into the
output shape `lax.dot_general` or `jnp.einsum` would return.
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp

from q8rules.q8_0 import BLOCK


@dataclasses.dataclass(frozen=True)
class WeightLayout:
  """How a float weight of `shape` is laid out as a (K, N) Q8_0 matrix, or as a stack of them.

  Attributes:
    shape: the float weight's shape.
    contract: the weight axes flattened into K, in order.
    free: the weight axes flattened into N, in order.
    batch: the weight axes kept as leading axes of the stored values, in order: a stack of
      experts (E, K, N), each expert's matrix Q8_0 along its own K (empty: one matrix).
  """

  shape: tuple[int, ...]
  contract: tuple[int, ...]
  free: tuple[int, ...]
  batch: tuple[int, ...] = ()

  @property
  def k(self) -> int:
    return math.prod(self.shape[a] for a in self.contract)

  @property
  def k_padded(self) -> int:
    return -(-self.k // BLOCK) * BLOCK

  @property
  def n(self) -> int:
    return math.prod(self.shape[a] for a in self.free)

  @property
  def batch_shape(self) -> tuple[int, ...]:
    """The sizes of the batch (expert) axes, in order."""
    return tuple(self.shape[a] for a in self.batch)

  @property
  def stored_shape(self) -> tuple[int, ...]:
    """The stored values' shape: (*batch_shape, K_padded, N)."""
    return (*self.batch_shape, self.k_padded, self.n)

  @property
  def blocked_axis(self) -> int:
    """The axis of the stored values blocked in 32s: K's."""
    return len(self.batch)

  def to_matrix(self, w: jax.Array) -> jax.Array:
    """(shape) -> (*batch_shape, K_padded, N): transpose, flatten, zero-pad K."""
    w2d = jnp.transpose(w, self.batch + self.contract + self.free)
    w2d = w2d.reshape(*self.batch_shape, self.k, self.n)
    if self.k_padded != self.k:
      pad = [(0, 0)] * len(self.batch) + [(0, self.k_padded - self.k), (0, 0)]
      w2d = jnp.pad(w2d, pad)
    return w2d

  def from_matrix(self, w2d: jax.Array) -> jax.Array:
    """(*batch_shape, K_padded, N) -> (shape): the inverse of `to_matrix`."""
    order = self.batch + self.contract + self.free
    moved = w2d[..., : self.k, :].reshape(tuple(self.shape[a] for a in order))
    return jnp.transpose(moved, [order.index(a) for a in range(len(self.shape))])

  def matrix(self) -> WeightLayout:
    """One matrix of the stack: this layout without its batch axes (itself when it has none)."""
    if not self.batch:
      return self
    keep = [a for a in range(len(self.shape)) if a not in self.batch]
    return WeightLayout(
      tuple(self.shape[a] for a in keep),
      tuple(keep.index(a) for a in self.contract),
      tuple(keep.index(a) for a in self.free),
    )


@dataclasses.dataclass(frozen=True)
class ProductLayout:
  """One product `x (*) w` as `(M, K) @ (K, N)`, or as E such products, one per expert, when the
  weight's expert axes are batch axes of the op (`lhs_batch`: `'BTED,EDF->BTEF'`).

  Attributes:
    weight: the weight's layout.
    lhs_contract: the activation axes matching `weight.contract`, pairwise.
    lhs_free: the other activation axes, in order (they become M).
    out_perm: the permutation taking `(*batch, *lhs_free, *weight.free)` to the op's output
      order (identity for dot_general); `batch` is the sizes of `weight.batch` when
      `lhs_batch` is set, else nothing.
    lhs_batch: the activation axes matching `weight.batch`, pairwise: a batched product, each
      expert's rows against its own matrix (empty: a plain product, or a grouped one, whose
      rows find their expert through the op's group sizes).
  """

  weight: WeightLayout
  lhs_contract: tuple[int, ...]
  lhs_free: tuple[int, ...]
  out_perm: tuple[int, ...]
  lhs_batch: tuple[int, ...] = ()

  @property
  def batched(self) -> bool:
    """Whether each expert of the weight multiplies its own activation rows (`lhs_batch`)."""
    return bool(self.lhs_batch)

  def check_lhs(self, lhs_shape: tuple[int, ...]) -> None:
    """Raise when the activation's contraction (or expert) sizes do not match the weight's."""
    pairs = [(self.lhs_contract, self.weight.contract, "contracts")]
    if self.batched:
      pairs.append((self.lhs_batch, self.weight.batch, "batches"))
    for mine, theirs, what in pairs:
      got = tuple(lhs_shape[a] for a in mine)
      want = tuple(self.weight.shape[a] for a in theirs)
      if got != want:
        raise ValueError(
          f"activation of shape {tuple(lhs_shape)} {what} axes {mine} of sizes {got} against"
          f" a weight {self.weight.shape} expecting {want}"
        )

  def lhs_matrix(self, x: jax.Array) -> jax.Array:
    """x -> (M, K_padded), or (E, M, K_padded) for a batched product (E the experts, in the
    order of `weight.batch`, flattened): transpose, flatten, zero-pad K."""
    m = math.prod(x.shape[a] for a in self.lhs_free)
    lead = (math.prod(x.shape[a] for a in self.lhs_batch),) if self.batched else ()
    order = self.lhs_batch + self.lhs_free + self.lhs_contract
    x2d = jnp.transpose(x, order).reshape(*lead, m, self.weight.k)
    if self.weight.k_padded != self.weight.k:
      pad = [(0, 0)] * (x2d.ndim - 1) + [(0, self.weight.k_padded - self.weight.k)]
      x2d = jnp.pad(x2d, pad)
    return x2d

  def output_shape(self, lhs_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of `(*batch, *lhs_free, *weight.free)` (the output before `out_perm`)."""
    batch = self.weight.batch_shape if self.batched else ()
    return (
      batch
      + tuple(lhs_shape[a] for a in self.lhs_free)
      + tuple(self.weight.shape[a] for a in self.weight.free)
    )

  def output(self, y2d: jax.Array, lhs_shape: tuple[int, ...]) -> jax.Array:
    """(M, N), or (E, M, N) for a batched product -> the op's output shape."""
    shape = self.output_shape(lhs_shape)
    y = y2d.reshape(shape)
    if self.out_perm != tuple(range(len(shape))):
      y = jnp.transpose(y, self.out_perm)
    return y


@dataclasses.dataclass(frozen=True)
class Q8How:
  """How a weight is stored as Q8_0; kept beside it in the param tree (Qwix's `WithAux.how`).

  Attributes:
    layout: where the float weight's axes go in the (K, N) matrix.
    scale_dtype: 'float32' or 'float16'.
    dtype: the float weight's dtype name (what dequantising gives back).
  """

  layout: WeightLayout
  scale_dtype: str
  dtype: str


class UnsupportedProduct(ValueError):
  """The op's shape of product has no Q8_0 weight-only form (it stays float)."""


def from_dot_general(
  lhs_ndim: int,
  rhs_shape: tuple[int, ...],
  dimension_numbers: jax.lax.DotDimensionNumbers,
) -> ProductLayout:
  """The layout of `lax.dot_general(x, w, dimension_numbers)` with w the weight."""
  (lc, rc), (lb, rb) = dimension_numbers
  pairs = sorted(
    zip((int(a) % len(rhs_shape) for a in rc), (int(a) % lhs_ndim for a in lc), strict=True)
  )
  contract = tuple(r for r, _ in pairs)
  lhs_contract = tuple(a for _, a in pairs)
  if not contract:
    raise UnsupportedProduct("the product contracts no axis")
  # dot_general's batch axes come first in its output, in the order given; the weight's are
  # stored in its own axis order (`batch_pairs`)
  batch_given = [(int(r) % len(rhs_shape), int(a) % lhs_ndim) for r, a in zip(rb, lb, strict=True)]
  batch_pairs = sorted(batch_given)
  batch = tuple(r for r, _ in batch_pairs)
  free = tuple(a for a in range(len(rhs_shape)) if a not in contract + batch)
  lhs_free = tuple(a for a in range(lhs_ndim) if a not in lhs_contract + tuple(lb))
  weight = WeightLayout(tuple(int(s) for s in rhs_shape), contract, free, batch)
  n_out = len(batch) + len(lhs_free) + len(free)
  perm = tuple(batch_pairs.index(p) for p in batch_given) + tuple(range(len(batch), n_out))
  return ProductLayout(weight, lhs_contract, lhs_free, perm, tuple(a for _, a in batch_pairs))


def from_ragged_dot(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> ProductLayout:
  """The layout of `jax.lax.ragged_dot(x, w, group_sizes)`: x (M, K) rows sorted by group, w
  (G, K, N) one (K, N) matrix per group (expert), stored as a stack of G Q8_0 matrices."""
  if len(lhs_shape) != 2 or len(rhs_shape) != 3:
    raise UnsupportedProduct(
      f"ragged_dot of x {tuple(lhs_shape)} and w {tuple(rhs_shape)}: q8rules serves x (M, K)"
      " and experts w (G, K, N)"
    )
  weight = WeightLayout(tuple(int(s) for s in rhs_shape), (1,), (2,), (0,))
  return ProductLayout(weight, (1,), (0,), (0, 1))


def _ellipsis_letters(lhs: str, lhs_ndim: int, used: set[str]) -> str:
  """Fresh index letters for the axes an ellipsis in `lhs` stands for."""
  if "..." not in lhs:
    return ""
  spare = [c for c in string.ascii_letters if c not in used]
  return "".join(spare[: lhs_ndim - (len(lhs) - 3)])


def from_einsum(einsum_str: str, lhs_ndim: int, rhs_shape: tuple[int, ...]) -> ProductLayout:
  """The layout of `jnp.einsum(einsum_str, x, w)` with w the weight (second operand)."""
  spec = einsum_str.replace(" ", "")
  if "->" not in spec:
    raise UnsupportedProduct(f"einsum {einsum_str!r} has no explicit output")
  inputs, out = spec.split("->")
  operands = inputs.split(",")
  if len(operands) != 2:
    raise UnsupportedProduct(f"einsum {einsum_str!r} does not have two operands")
  lhs, rhs = operands
  used = set(spec) - {".", ",", "-", ">"}
  if "..." in rhs:
    raise UnsupportedProduct(f"einsum {einsum_str!r}: an ellipsis in the weight")
  ellipsis = _ellipsis_letters(lhs, lhs_ndim, used)
  lhs, out = lhs.replace("...", ellipsis), out.replace("...", ellipsis)
  if len(lhs) != lhs_ndim or len(rhs) != len(rhs_shape):
    raise UnsupportedProduct(f"einsum {einsum_str!r} does not match the operand ranks")
  if len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
    raise UnsupportedProduct(f"einsum {einsum_str!r} repeats an index in one operand")
  batch = [c for c in rhs if c in lhs and c in out]
  summed_rhs = [c for c in rhs if c not in lhs and c not in out]
  summed_lhs = [c for c in lhs if c not in rhs and c not in out]
  if summed_rhs or summed_lhs:
    raise UnsupportedProduct(f"einsum {einsum_str!r} sums an index of one operand alone")
  contract = [c for c in rhs if c in lhs and c not in out]
  layout = from_dot_general(
    lhs_ndim,
    rhs_shape,
    (
      ([lhs.index(c) for c in contract], [rhs.index(c) for c in contract]),
      ([lhs.index(c) for c in batch], [rhs.index(c) for c in batch]),
    ),
  )
  dg_out = (
    [rhs[a] for a in layout.weight.batch]
    + [lhs[a] for a in layout.lhs_free]
    + [rhs[a] for a in layout.weight.free]
  )
  if sorted(dg_out) != sorted(out):
    raise UnsupportedProduct(f"einsum {einsum_str!r}: output indices do not match")
  return dataclasses.replace(layout, out_perm=tuple(dg_out.index(c) for c in out))
