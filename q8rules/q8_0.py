"""The Q8_0 format: quantize, dequantize and the `Q8Array` that holds both parts.

Q8_0 is llama.cpp's 8-bit format. Along one axis (the contraction axis K of a
weight) values are grouped in blocks of 32; each block has one scale `d` and 32
int8 values `q`, and `w = q * d`. The quantizer is llama.cpp's
`quantize_row_q8_0_ref` (and `gguf.quants.Q8_0`), bit for bit:

    amax = max |w|           over the block, in float32
    d    = amax / 127        float32
    id   = 1 / d if d else 0 float32
    q    = roundf(w * id)    half away from zero, as int8

A block of zeros gets `d = 0, q = 0`. Scales are stored float32 (the default)
or float16 (what GGUF stores); `q` always comes from the float32 `d`, as in
llama.cpp.

The result is the reference's on every backend. Accelerators (and XLA on
CPU) may flush float32 subnormals to zero, and a GPU's float32 division need
not be correctly rounded, while the reference computes with both. So every
division (`amax / 127`, `1 / d`) is done exactly on the integer bits
(`_div_rn`), and blocks whose largest magnitude is below 2**-100 are computed
on exactly rescaled values (`_tiny_blocks`). Non-finite values are found with
`isfinite`, not through the maximum (a GPU's fast max may drop a NaN): such a
block gets a NaN scale, so it dequantizes to NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
"""Rows of a Q8_0 block."""

_F32_EXP_SHIFT = 23
_TINY_EXP = 27  # biased exponent of 2**-100: blocks below it take the exact rescaled path
_SHIFT = 64  # power of two the tiny blocks are rescaled by


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q8Array:
  """A Q8_0-quantized array: int8 values and one scale per 32-block.

  Attributes:
    q: int8, the shape of the quantized array.
    scale: float32 or float16, `q`'s shape with `axis` divided by 32.
    axis: the blocked axis (static).
    dtype: the float dtype `dequantize` returns (static); the dtype the
      original array had.
  """

  q: jax.Array
  scale: jax.Array
  axis: int = dataclasses.field(default=0, metadata=dict(static=True))
  dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  @property
  def ndim(self) -> int:
    return len(self.q.shape)

  @property
  def nbytes(self) -> int:
    """Bytes the two parts take: 1 per value plus the scales."""
    return (
      int(np.prod(self.q.shape))
      + int(np.prod(self.scale.shape)) * np.dtype(self.scale.dtype).itemsize
    )

  def __repr__(self) -> str:
    if not hasattr(self.q, "shape") or not hasattr(self.scale, "dtype"):  # leaves of a tree.map
      return f"Q8Array(q={self.q!r}, scale={self.scale!r}, axis={self.axis})"
    return (
      f"Q8Array(shape={self.shape}, axis={self.axis},"
      f" scale_dtype={np.dtype(self.scale.dtype).name},"
      f" dtype={np.dtype(self.dtype).name})"
    )


def _roundf(x: jax.Array) -> jax.Array:
  """C `roundf`: round half away from zero, exactly (as `gguf.quants.np_roundf`)."""
  a = jnp.abs(x)
  floored = jnp.floor(a)
  return jnp.sign(x) * (floored + jnp.floor(2 * (a - floored)))


def _div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
  """a / b rounded to nearest even, for positive normal float32 a and b whose quotient is a
  normal float32; computed by long division on the significands (uint32), so it is exact on
  every backend whatever its float division does. Other inputs give unspecified values:
  callers select around them.

  With a = ma * 2**ea and b = mb * 2**eb (24-bit significands), ma / mb lies in (1/2, 2);
  after doubling ma when ma < mb it lies in [1, 2). The integer bit is 1, the remainder
  r = ma - mb < mb < 2**24, and three steps of 8 bits (r * 256 < 2**32) give 23 fraction
  bits and a round bit; the final remainder is the sticky bit.
  """
  ab = jax.lax.bitcast_convert_type(a, jnp.uint32)
  bb = jax.lax.bitcast_convert_type(b, jnp.uint32)
  hidden = jnp.uint32(1 << _F32_EXP_SHIFT)
  ma = (ab & jnp.uint32(0x7FFFFF)) | hidden
  mb = (bb & jnp.uint32(0x7FFFFF)) | hidden
  ea = (ab >> _F32_EXP_SHIFT).astype(jnp.int32)
  eb = (bb >> _F32_EXP_SHIFT).astype(jnp.int32)
  low = ma < mb
  ma = jnp.where(low, ma << 1, ma)
  exp = ea - eb + 127 - low.astype(jnp.int32)  # the quotient's biased exponent
  r = ma - mb
  quot = jnp.ones_like(ma)
  for _ in range(3):
    r = r << 8
    digit = r // mb
    r = r - digit * mb
    quot = (quot << 8) | digit
  # quot: 25 bits, the 24-bit significand and a round bit; r != 0 is the sticky bit.
  mant = quot >> 1
  up = (quot & 1) & ((r != 0) | (mant & 1)).astype(jnp.uint32)
  bits = (exp.astype(jnp.uint32) << _F32_EXP_SHIFT) + (mant + up - hidden)  # a carry bumps exp
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _div127(x: jax.Array) -> jax.Array:
  """x / 127 correctly rounded, for float32 x >= 0 whose quotient is 0 or a normal float32."""
  return jnp.where(x == 0, np.float32(0), _div_rn(x, jnp.full_like(x, 127, jnp.float32)))


def _recip(d: jax.Array) -> jax.Array:
  """1 / d correctly rounded, for float32 d > 0 whose reciprocal is a normal float32."""
  return _div_rn(jnp.ones_like(d, jnp.float32), d)


def _scale_up_exact(bits: jax.Array) -> jax.Array:
  """|value| * 2**64 for float32 values given as int32 bits, exact, with no float op
  on a subnormal (which would be flushed to zero)."""
  exp = (bits >> _F32_EXP_SHIFT) & 0xFF
  mant = bits & 0x7FFFFF
  sign = jnp.where(bits < 0, -1.0, 1.0).astype(jnp.float32)
  normal = jax.lax.bitcast_convert_type(
    (bits & 0x7FFFFFFF) + (_SHIFT << _F32_EXP_SHIFT), jnp.float32
  )
  subnormal = mant.astype(jnp.float32) * np.float32(2.0 ** (_SHIFT - 149))
  return sign * jnp.where(exp == 0, subnormal, normal)


def _tiny_blocks(bits: jax.Array, amax_bits: jax.Array):
  """Scale and q for blocks with amax < 2**-100, exactly as the float32 reference.

  bits: int32 (B, 32, ...) raw float bits; amax_bits: int32 (B, 1, ...).
  Returns (d float32 (B, 1, ...), q float32 (B, 32, ...)).
  """
  w_up = _scale_up_exact(bits)  # w * 2**64, all normal
  amax_up = _scale_up_exact(amax_bits)
  # Where the reference's d = amax/127 is a normal float32, it equals
  # (amax*2**64)/127 * 2**-64 exactly, and so does 1/d after the shift.
  d_up = _div127(amax_up)
  d_normal = d_up * np.float32(2.0**-_SHIFT)
  id_up_normal = _recip(d_up)
  # Where d is subnormal, do the division on the integer grid of subnormals:
  # amax = n * 2**-149 with n < 2**30, d = round(n / 127) * 2**-149 (127 is odd,
  # so there are no ties).
  exp = amax_bits >> _F32_EXP_SHIFT
  mant = amax_bits & 0x7FFFFF
  n = jnp.where(exp == 0, mant, (mant | (1 << _F32_EXP_SHIFT)) << jnp.maximum(exp - 1, 0))
  d_int = n // 127 + (2 * (n % 127) > 127).astype(n.dtype)
  d_sub = jax.lax.bitcast_convert_type(d_int, jnp.float32)  # d_int * 2**-149
  # 1/d = 2**149 / d_int: computed as 2**85 / d_int, then shifted by 2**64.
  d_int_f = jnp.maximum(d_int, 1).astype(jnp.float32)  # exact: d_int < 2**24
  id_sub_up = _div_rn(jnp.full_like(d_int_f, 2.0**85, jnp.float32), d_int_f)
  overflow = id_sub_up >= np.float32(2.0**64)  # the reference's 1/d is inf: q = 0
  id_sub_up = jnp.where((d_int == 0) | overflow, 0, id_sub_up)
  d_is_normal = d_up >= np.float32(2.0 ** (-126 + _SHIFT))
  d = jnp.where(d_is_normal, d_normal, d_sub)
  id_up = jnp.where(d_is_normal, id_up_normal, id_sub_up)
  return d, _roundf(w_up * id_up)


@jax.jit  # one compiled call per shape, not ~150 op-by-op dispatches when run eagerly
def _quantize_blocks(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q8_0 of float32 blocks (B, 32, ...): (d float32 (B, 1, ...), q int8 (B, 32, ...)).

  A block holding a nan or an inf gets d = nan and q = 0 (it dequantizes to nan).
  """
  finite = jnp.all(jnp.isfinite(blocks), axis=1, keepdims=True)
  blocks = jnp.where(finite, blocks, np.float32(0))
  bits = jax.lax.bitcast_convert_type(blocks, jnp.int32)
  # max |w| on the bits: exact for every finite non-negative float, subnormals included.
  amax_bits = jnp.max(bits & 0x7FFFFFFF, axis=1, keepdims=True)
  amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
  tiny = amax_bits < (_TINY_EXP << _F32_EXP_SHIFT)
  # Normal blocks: amax >= 2**-100, so d >= 2**-107 and 1/d < 2**107 are normal.
  d = _div127(jnp.where(tiny, np.float32(1), amax))
  q = _roundf(blocks * _recip(d))
  d_tiny, q_tiny = _tiny_blocks(bits, amax_bits)
  d = jnp.where(tiny, d_tiny, d)
  q = jnp.where(tiny, q_tiny, q)
  d = jnp.where(finite, d, np.float32(np.nan))
  q = jnp.where(finite, q, 0)
  return d, q.astype(jnp.int8)


def _non_finite_message(name: str) -> str:
  return f"cannot quantize {name} to Q8_0: it holds non-finite values (nan or inf)"


def checked_finite(w: jax.Array, name: str) -> jax.Array:
  """A boolean scalar that is True when `w` is all finite; raise ValueError when it is not.

  Concrete arrays are checked here. Traced ones are checked when the program runs, by a
  pure callback whose result the scales depend on: a callback with an effect (like
  `jax.debug.callback`) would make every traced quantizer an effect, which Flax's
  `nn.scan` refuses at init ("broadcasted variable has a data dependency on the scan body").
  """
  finite = jnp.all(jnp.isfinite(w))
  if not isinstance(finite, jax.core.Tracer):
    if not bool(finite):
      raise ValueError(_non_finite_message(name))
    return finite

  def check(ok: np.ndarray) -> np.ndarray:
    if not np.all(ok):
      raise ValueError(_non_finite_message(name))
    return np.asarray(ok, np.bool_)

  return jax.pure_callback(
    check, jax.ShapeDtypeStruct(finite.shape, jnp.bool_), finite, vmap_method="sequential"
  )


def quantize(
  w: jax.Array | np.ndarray,
  axis: int = 0,
  scale_dtype: Any = jnp.float32,
  *,
  name: str = "weight",
  check_finite: bool = True,
) -> Q8Array:
  """Quantizes `w` to Q8_0 in blocks of 32 along `axis`.

  Args:
    w: float array (float32, bfloat16 or float16) of any rank; `w.shape[axis]`
      must be a multiple of 32.
    axis: the axis blocked (the contraction axis of a weight), in
      [-w.ndim, w.ndim); anything else raises.
    scale_dtype: float32 (default) or float16 (GGUF's; `q` is still computed
      from the float32 scale, as llama.cpp does).
    name: how error messages name `w`.
    check_finite: raise on nan/inf (at run time when traced).

  Returns:
    A `Q8Array` with `q` int8 of `w.shape` and `scale` of `w.shape` with
    `axis` divided by 32.
  """
  w = jnp.asarray(w)
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"cannot quantize {name} to Q8_0: dtype {w.dtype} is not floating point")
  scale_dtype = np.dtype(scale_dtype)
  if scale_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
    raise ValueError(f"scale_dtype must be float32 or float16, got {scale_dtype} (for {name})")
  if w.ndim == 0:
    raise ValueError(f"cannot quantize scalar {name} to Q8_0")
  if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
    raise TypeError(f"cannot quantize {name} to Q8_0: axis must be an int, got {axis!r}")
  if not -w.ndim <= axis < w.ndim:
    raise ValueError(
      f"cannot quantize {name} of shape {tuple(w.shape)} to Q8_0: axis {axis} is out of"
      f" range for rank {w.ndim} (valid: {-w.ndim} to {w.ndim - 1})"
    )
  axis = int(axis) % w.ndim
  k = w.shape[axis]
  if k % BLOCK:
    raise ValueError(
      f"cannot quantize {name} of shape {w.shape} to Q8_0: axis {axis} has"
      f" {k} rows, not a multiple of {BLOCK}"
    )
  if _on_one_device(w):
    q, d, finite = _quantize_in_rows(w, axis, scale_dtype)
    if check_finite and not bool(finite):
      raise ValueError(_non_finite_message(name))
    return Q8Array(q=q, scale=d, axis=axis, dtype=w.dtype)
  moved = jnp.moveaxis(w.astype(jnp.float32), axis, 0)
  rest = moved.shape[1:]
  d, q = _quantize_blocks(moved.reshape(k // BLOCK, BLOCK, *rest))
  if check_finite:  # both parts depend on the check, so it runs whichever part is used
    ok = checked_finite(w, name)
    d, q = jnp.where(ok, d, np.float32(np.nan)), jnp.where(ok, q, jnp.int8(0))
  q = jnp.moveaxis(q.reshape(k, *rest), 0, axis)
  d = jnp.moveaxis(d.reshape(k // BLOCK, *rest), 0, axis)
  return Q8Array(q=q, scale=d.astype(scale_dtype), axis=axis, dtype=w.dtype)


ROWS_PER_CALL = 1 << 16
"""Blocks the block quantizer takes a call when it quantizes a large concrete weight (8 MiB of
float32); a weight of at most `SMALL_ROWS` blocks takes one call of `SMALL_ROWS`. With two sizes a
process compiles the block quantizer at most twice (XLA takes a second or more to compile it),
not once per weight shape."""

SMALL_ROWS = 1 << 12
"""Blocks of the one call that quantizes a small concrete weight (512 KiB of float32)."""


def _on_one_device(w: jax.Array) -> bool:
  """Whether `w` is a concrete array on one device (not traced, not sharded over several)."""
  return not isinstance(w, jax.core.Tracer) and len(w.sharding.device_set) == 1


@functools.partial(jax.jit, static_argnames=("axis", "rows"))
def _to_rows(w: jax.Array, axis: int, rows: int) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """`w`'s blocks of 32 along `axis` as float32 rows, zero-padded to whole calls of `rows`.

  Returns ((rows, 32) float32 chunks, whether every value of `w` is finite).
  """
  moved = jnp.moveaxis(w.astype(jnp.float32), axis, 0)
  blocks = jnp.swapaxes(moved.reshape(moved.shape[0] // BLOCK, BLOCK, -1), 1, 2).reshape(-1, BLOCK)
  n = blocks.shape[0]
  calls = -(-n // rows)
  blocks = jnp.pad(blocks, ((0, calls * rows - n), (0, 0)))
  return tuple(blocks[i * rows : (i + 1) * rows] for i in range(calls)), jnp.all(jnp.isfinite(w))


@functools.partial(jax.jit, static_argnames=("shape", "axis", "scale_dtype"))
def _from_rows(
  ds: tuple[jax.Array, ...],
  qs: tuple[jax.Array, ...],
  shape: tuple[int, ...],
  axis: int,
  scale_dtype: np.dtype,
) -> tuple[jax.Array, jax.Array]:
  """The quantized rows of `_to_rows` back in the weight's layout: (q int8 `shape`, scale
  `scale_dtype` of `shape` with `axis` divided by 32)."""
  moved = (shape[axis], *shape[:axis], *shape[axis + 1 :])
  nblocks = moved[0] // BLOCK
  n = nblocks * int(np.prod(moved[1:], dtype=np.int64))
  d = jnp.concatenate(ds)[:n, 0].reshape(nblocks, *moved[1:])
  q = jnp.concatenate(qs)[:n].reshape(nblocks, -1, BLOCK)
  q = jnp.swapaxes(q, 1, 2).reshape(moved)
  return jnp.moveaxis(q, 0, axis), jnp.moveaxis(d, 0, axis).astype(scale_dtype)


def _quantize_in_rows(
  w: jax.Array, axis: int, scale_dtype: np.dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Q8_0 of a concrete weight through block-quantizer calls of two fixed sizes.

  The same bits as one call over the weight's own shape: each block's scale and values depend on
  that block alone. Returns (q int8 of w's shape, scale, whether w is all finite).
  """
  blocks = w.size // BLOCK
  rows = SMALL_ROWS if blocks <= SMALL_ROWS else ROWS_PER_CALL
  chunks, finite = _to_rows(w, axis, rows)
  parts = [_quantize_blocks(chunk) for chunk in chunks]
  q, d = _from_rows(
    tuple(d for d, _ in parts), tuple(q for _, q in parts), tuple(w.shape), axis, scale_dtype
  )
  return q, d, finite


def dequantize_blocks(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
  """`q * d` blocked along axis 0: the one Q8_0 dequantiser (the products' and `dequantize`'s).

  Args:
    q: int8 (K, ...), K a multiple of 32 (a whole weight, or a K-slice of whole blocks).
    scale: float32 or float16 (K/32, ...), q's shape with the first axis divided by 32.
    dtype: the result's dtype.

  Returns:
    (K, ...) in `dtype`: each value multiplied by its block's scale in float32, then cast.
  """
  k, rest = q.shape[0], tuple(q.shape[1:])
  blocks = q.reshape(k // BLOCK, BLOCK, *rest).astype(jnp.float32)
  w = blocks * scale.astype(jnp.float32).reshape(k // BLOCK, 1, *rest)
  return w.reshape(k, *rest).astype(dtype)


def dequantize(a: Q8Array) -> jax.Array:
  """`q * d` in float32, cast to `a.dtype`, of `a.shape`."""
  q = jnp.moveaxis(a.q, a.axis, 0)
  scale = jnp.moveaxis(a.scale, a.axis, 0)
  return jnp.moveaxis(dequantize_blocks(q, scale, a.dtype), 0, a.axis)
