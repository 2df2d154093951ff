"""The accelerator's prefill product in XLA: dequantise the weight in large pieces, one dot each.

On a GPU or TPU a many-row product is bound by the matrix units, not by reading
the weight, so the weight is dequantised into the activations' dtype (bf16 or
f16 for 16-bit activations, float32 for float32 ones) in pieces of at most
`PIECE_BYTES` (one piece for most weights) and each piece goes through one
dot on the matrix units with float32 accumulation. Accuracy: for 16-bit
activations the weight is rounded to their dtype first (bf16: 2^-9 relative
per value; f16: 2^-12, and a dequantised value over 65504 would overflow, which
no Q8_0 weight of a real model reaches), so the product is within that dtype's
accuracy of float64, not float32's; float32 activations dot a float32 weight at
`Precision.HIGHEST` (IEEE, not TF32), within float32 accumulation of float64.
The CPU keeps the cache-sized scan of `xla_chunked` (docs/design.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels.matmul.xla_chunked import scan_row_chunks
from q8rules.kernels.problem import Problem
from q8rules.q8_0 import BLOCK, dequantize_blocks

NAME = "xla_dequant"
SUMMARY = (
  "the weight dequantised into the activations' dtype in large pieces, one dot each"
  " (many-row products on GPU and TPU)"
)
ROUNDS_WEIGHT = True
"""bf16/f16 activations meet the weight rounded to their dtype: the product is within that
dtype's accuracy of float64."""

PIECE_BYTES = 512 << 20
"""The most bytes of dequantised weight one piece holds (K is cut into pieces of whole
Q8_0 blocks when the weight is larger)."""


def dequant_dtype(x_dtype) -> np.dtype:
  """The dtype the weight is dequantised into for activations of `x_dtype`: bf16 and f16
  stay themselves, float32 stays float32."""
  dt = np.dtype(x_dtype)
  if dt in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
    return dt
  return np.dtype(jnp.float32)


def piece_rows(k: int, n: int, itemsize: int, budget: int = PIECE_BYTES) -> int:
  """Weight rows per piece: all of K when K x N values of `itemsize` bytes fit in `budget`,
  else the most whole Q8_0 blocks that do (at least one)."""
  if k * n * itemsize <= budget:
    return k
  return max(BLOCK, budget // (n * itemsize) // BLOCK * BLOCK)


def _piece_product(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """x (M, r) @ (q (r, N) int8 * scale (r/32, N)) dequantised into x's dtype -> (M, N) f32."""
  w = dequantize_blocks(q, scale, x.dtype)
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)


def q8_matmul_dequant(
  x: jax.Array, q: jax.Array, scale: jax.Array, *, piece_bytes: int = PIECE_BYTES
) -> jax.Array:
  """`x @ (q * scale)` with the weight dequantised into x's dtype, a piece at a time.

  Args:
    x: (M, K) float32, bfloat16 or float16 activations.
    q: (K, N) int8 Q8_0 values, K a multiple of 32.
    scale: (K/32, N) float32 or float16 Q8_0 scales.
    piece_bytes: the most bytes of dequantised weight a piece holds; pieces are
      whole Q8_0 blocks of K, run in a scan, with a last smaller piece.

  Returns:
    (M, N) float32, accumulated in float32.

  The operands are trusted (`q8_matmul` checks them: `problem.check_operands`).
  """
  k, n = q.shape
  dt = dequant_dtype(x.dtype)
  x = x.astype(dt)
  c = piece_rows(k, n, dt.itemsize, piece_bytes)
  if c >= k:
    return _piece_product(x, q, scale)
  return scan_row_chunks(x, q, scale, c, _piece_product)


def cannot(p: Problem) -> None:
  """Dequantising in pieces runs every problem."""
  del p


def slower(p: Problem) -> str | None:
  """On CPU `implementation=None` keeps the cache-sized scan."""
  if p.platform == "cpu":
    return "on CPU the cache-sized scan ('xla') is faster (docs/design.md)"
  return None


def run(x2d: jax.Array, q: jax.Array, scale: jax.Array, platform: str, interpret: bool | None):
  """The registry's call: `q8_matmul_dequant(x2d, q, scale)`, (m, N) float32."""
  del platform, interpret
  return q8_matmul_dequant(x2d, q, scale)


__all__ = [
  "NAME",
  "PIECE_BYTES",
  "ROUNDS_WEIGHT",
  "SUMMARY",
  "cannot",
  "dequant_dtype",
  "piece_rows",
  "q8_matmul_dequant",
  "run",
  "slower",
]
