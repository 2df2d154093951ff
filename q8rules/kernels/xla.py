"""The XLA Q8_0 product for every shape and backend: a scan over K chunks.

Each step dequantises one chunk of rows (`chunk` x N, float32) and multiplies
it into an fp32 accumulator, so no float weight wider than a chunk ever
exists (the whole-weight dequantise-then-dot is 10x slower on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.q8_0 import BLOCK

DEFAULT_CHUNK = 256


def _chunk_rows(k: int, chunk: int) -> int:
  """The largest multiple of 32 that divides k and is at most `chunk`."""
  c = min(chunk, k) // BLOCK * BLOCK
  while k % c:
    c -= BLOCK
  return c


def q8_matmul_xla(
  x: jax.Array, q: jax.Array, scale: jax.Array, *, chunk: int = DEFAULT_CHUNK
) -> jax.Array:
  """`x @ (q * scale)` in K chunks: x (M, K) float, q (K, N) int8, scale (K/32, N) -> (M, N) float32."""
  m, k = x.shape
  n = q.shape[1]
  c = _chunk_rows(k, chunk)
  steps = k // c
  xs = x.astype(jnp.float32).reshape(m, steps, c).transpose(1, 0, 2)
  qs = q.reshape(steps, c // BLOCK, BLOCK, n)
  ss = scale.astype(jnp.float32).reshape(steps, c // BLOCK, 1, n)

  def step(acc, chunk_in):
    xi, qi, si = chunk_in
    wi = (qi.astype(jnp.float32) * si).reshape(c, n)
    return acc + jnp.dot(xi, wi, precision=jax.lax.Precision.HIGHEST), None

  acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), (xs, qs, ss))
  return acc
