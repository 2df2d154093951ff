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

Accelerators (and XLA on CPU) flush float32 subnormals to zero, while the
reference computes with them. Blocks whose largest magnitude is below 2**-100
are therefore computed on exactly rescaled values (a power-of-two shift done on
the bits), so the result equals the reference there too; see `_tiny_blocks`.
"""

from __future__ import annotations

import dataclasses
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


def _div127(x: jax.Array) -> jax.Array:
  """x / 127, correctly rounded.

  XLA rewrites a division by a broadcast constant into a multiplication by its
  (rounded) reciprocal, which is off by an ulp for about 4.5 % of inputs; an
  opaque divisor keeps the true division. The quotient is opaque too: otherwise
  XLA folds a later `1 / d` into `127 / x`, which rounds differently (q off by
  one at near-ties under jit).
  """
  return jax.lax.optimization_barrier(
    x / jax.lax.optimization_barrier(jnp.full(x.shape, 127, jnp.float32))
  )


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
  id_up_normal = np.float32(1) / d_up
  # Where d is subnormal, do the division on the integer grid of subnormals:
  # amax = n * 2**-149 with n < 2**30, d = round(n / 127) * 2**-149 (127 is odd,
  # so there are no ties).
  exp = amax_bits >> _F32_EXP_SHIFT
  mant = amax_bits & 0x7FFFFF
  n = jnp.where(exp == 0, mant, (mant | (1 << _F32_EXP_SHIFT)) << jnp.maximum(exp - 1, 0))
  d_int = n // 127 + (2 * (n % 127) > 127).astype(n.dtype)
  d_sub = jax.lax.bitcast_convert_type(d_int, jnp.float32)  # d_int * 2**-149
  # 1/d = 2**149 / d_int: computed as 2**85 / d_int, then shifted by 2**64.
  id_sub_up = np.float32(2.0**85) / d_int.astype(jnp.float32)
  overflow = id_sub_up >= np.float32(2.0**64)  # the reference's 1/d is inf: q = 0
  id_sub_up = jnp.where((d_int == 0) | overflow, 0, id_sub_up)
  d_is_normal = d_up >= np.float32(2.0 ** (-126 + _SHIFT))
  d = jnp.where(d_is_normal, d_normal, d_sub)
  id_up = jnp.where(d_is_normal, id_up_normal, id_sub_up)
  return d, _roundf(w_up * id_up)


def _quantize_blocks(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q8_0 of float32 blocks (B, 32, ...): (d float32 (B, 1, ...), q int8 (B, 32, ...))."""
  bits = jax.lax.bitcast_convert_type(blocks, jnp.int32)
  # max |w| on the bits: exact for every non-negative float, subnormals included.
  amax_bits = jnp.max(bits & 0x7FFFFFFF, axis=1, keepdims=True)
  amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
  d = _div127(amax)
  inv_d = jnp.where(d == 0, 0, np.float32(1) / d)
  q = _roundf(blocks * inv_d)
  tiny = amax_bits < (_TINY_EXP << _F32_EXP_SHIFT)
  d_tiny, q_tiny = _tiny_blocks(bits, amax_bits)
  d = jnp.where(tiny, d_tiny, d)
  q = jnp.where(tiny, q_tiny, q)
  return d, q.astype(jnp.int8)


def _check_finite(w: jax.Array, name: str) -> None:
  """Raise ValueError on non-finite values; under tracing, at run time."""
  bad = ~jnp.all(jnp.isfinite(w))

  def raise_if(flag) -> None:
    if bool(flag):
      raise ValueError(f"cannot quantize {name} to Q8_0: it holds non-finite values (nan or inf)")

  if isinstance(bad, jax.core.Tracer):
    jax.debug.callback(raise_if, bad)
  else:
    raise_if(bad)


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
  if check_finite:
    _check_finite(w, name)
  moved = jnp.moveaxis(w.astype(jnp.float32), axis, 0)
  rest = moved.shape[1:]
  d, q = _quantize_blocks(moved.reshape(k // BLOCK, BLOCK, *rest))
  q = jnp.moveaxis(q.reshape(k, *rest), 0, axis)
  d = jnp.moveaxis(d.reshape(k // BLOCK, *rest), 0, axis)
  return Q8Array(q=q, scale=d.astype(scale_dtype), axis=axis, dtype=w.dtype)


def expand_scale(a: Q8Array) -> jax.Array:
  """The scale repeated over each block's 32 rows: float32 of `a.shape`."""
  return jnp.repeat(a.scale.astype(jnp.float32), BLOCK, axis=a.axis)


def dequantize(a: Q8Array) -> jax.Array:
  """`q * d` in float32, cast to `a.dtype`, of `a.shape`."""
  return (a.q.astype(jnp.float32) * expand_scale(a)).astype(a.dtype)
