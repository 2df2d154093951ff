"""The Q8_0 x Q8_0 product's numerics: the activations' Q8_0 (gguf.quants bit for bit), their
round trip, and the float64 reference every implementation is held to.

  xq, dx = Q8_0(x) per row, blocks of 32 along K (`q8rules.q8_0.quantize`), dx the float16
           scale as GGUF stores it, widened;
  y[r, n] = sum_b (dx[r, b] * dw[b, n]) * sum_i xq[r, 32b + i] * q[32b + i, n].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.q8_0 import BLOCK, quantize


def quantize_activations(x2d: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q8_0 of activations x2d (m, K) along K: int8 values (m, K) and float32 scales (m, K/32),
  the float16 d of GGUF's blocks widened (gguf.quants bit for bit). Non-finite values are not
  refused (activations are run-time data): they give non-finite outputs."""
  a = quantize(x2d.astype(jnp.float32), axis=1, scale_dtype=jnp.float16, check_finite=False)
  return a.q, a.scale.astype(jnp.float32)


def round_trip(x2d: jax.Array) -> jax.Array:
  """The activations as their Q8_0 blocks hold them: dx * xq, (m, K) float32 (exact: an 11-bit
  scale times a 7-bit integer). A weight-only product of it is the Q8_0 x Q8_0 product to
  float32 rounding (each dx * xq * q needs up to 25 bits)."""
  m, k = x2d.shape
  xq, dx = quantize_activations(x2d)
  blocks = xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK) * dx[:, :, None]
  return blocks.reshape(m, k)


def reference_float64(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """The product in numpy float64 from the same Q8_0 activations (for tests and benchmarks):
  (m, K) float, (K, N) int8, (K/32, N) -> (m, N) float64."""
  xq, dx = (np.asarray(a) for a in quantize_activations(jnp.asarray(x, jnp.float32)))
  m, k = xq.shape
  nb = k // BLOCK
  dots = np.einsum(
    "mbi,bin->mbn",
    xq.reshape(m, nb, BLOCK).astype(np.int64),
    np.asarray(q).reshape(nb, BLOCK, -1).astype(np.int64),
  )
  d = dx.astype(np.float64)[:, :, None] * np.asarray(scale, np.float64)[None]
  return np.sum(dots * d, axis=1)


__all__ = ["quantize_activations", "reference_float64", "round_trip"]
