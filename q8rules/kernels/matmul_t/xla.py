"""'xla': the transposed product in plain XLA on every backend, the weight dequantised a chunk
of K rows (or, for many rows of dy, of N columns) at a time.

Each step of a `lax.map` over K dequantises `c` rows (q (c, N) int8 times their scales, one
float32 (c, N) slab) and dots dy (m, N) with the slab's transpose into (m, c) at
`Precision.HIGHEST` (IEEE float32 on GPU too, not TF32); the steps' outputs are K's columns.
When dy has more rows than such a chunk (`xla_chunked.column_chunk`: training, prefill), every
step would read the whole (m, N) dy for a thin dot; there a scan over chunks of N's columns
dequantises a (K, cn) slab and adds dy[:, cols] @ slab^T into an (m, K) accumulator.
At most one slab of float weight exists at a time: never the whole (K, N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.matmul.xla_chunked import column_chunk, default_chunk
from q8rules.kernels.matmul_t.problem import TransposedProblem
from q8rules.q8_0 import BLOCK, dequantize_blocks

NAME = "xla"
SUMMARY = "K-chunked dequantise-and-dot with the slab's transpose in plain XLA, every backend"


def _after(dy: jax.Array, scale: jax.Array) -> jax.Array:
  """`scale` as float32, made to depend on dy's first value (plus a zero that XLA cannot fold:
  0 whatever that value is, NaN and infinities included), so the slab it dequantises cannot be
  computed before dy exists.

  Without it XLA:CPU's scheduler computes the backward pass's slabs, which read only params,
  early, in the forward pass, and holds every layer's float weight until its transposed
  product: a 135M decoder's training step took 393 MB more temporaries than the float32
  model's (benchmarks/RESULTS.md `lora`). `optimization_barrier` does not stop it on the CPU.
  """
  if dy.size == 0:
    return scale.astype(jnp.float32)
  d = dy[0, 0].astype(jnp.float32)
  zero = jnp.where(jnp.isnan(d), jnp.float32(0), jnp.minimum(jnp.abs(d), jnp.float32(0)))
  return scale.astype(jnp.float32) + zero


def _rows(dy: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """dy (M, N) float32 @ (q (c, N) int8 * scale (c/32, N))^T -> (M, c) float32."""
  slab = dequantize_blocks(q, _after(dy, scale))
  return jnp.dot(
    dy, slab.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )


def q8_matmul_t_xla(
  dy: jax.Array, q: jax.Array, scale: jax.Array, *, chunk: int | None = None
) -> jax.Array:
  """`dy @ (q * scale)^T` in chunks of K rows.

  Args:
    dy: (M, N) float32, bfloat16 or float16 (converted to float32, exactly).
    q: (K, N) int8 Q8_0 values, K a multiple of 32.
    scale: (K/32, N) float32 or float16 Q8_0 scales.
    chunk: weight rows dequantised per step (rounded down to a multiple of 32, at least 32);
      None picks the forward product's chunks: `xla_chunked.column_chunk` columns of N when
      it gives some, else `xla_chunked.default_chunk` rows (about 8 MiB of float32, at most
      1024 rows and half of K). A K (N) that is not a multiple of it ends with one smaller
      chunk.

  Returns:
    (M, K) float32.
  """
  m = dy.shape[0]
  k, n = q.shape
  dy = dy.astype(jnp.float32)
  columns = column_chunk(m, k, n) if chunk is None else None
  if columns is not None:
    return _column_chunks(dy, q, scale, columns)
  c = default_chunk(m, k, n) if chunk is None else chunk
  c = max(BLOCK, min(c, k) // BLOCK * BLOCK)
  steps, rem = divmod(k, c)
  main = steps * c

  def step(i: jax.Array) -> jax.Array:
    qi = jax.lax.dynamic_slice_in_dim(q, i * c, c, axis=0)
    si = jax.lax.dynamic_slice_in_dim(scale, i * (c // BLOCK), c // BLOCK, axis=0)
    return _rows(dy, qi, si)

  parts = jax.lax.map(step, jnp.arange(steps, dtype=jnp.int32))  # (steps, M, c)
  out = parts.transpose(1, 0, 2).reshape(m, main)
  if rem:
    out = jnp.concatenate([out, _rows(dy, q[main:], scale[main // BLOCK :])], axis=1)
  return out


def _column_chunks(dy: jax.Array, q: jax.Array, scale: jax.Array, c: int) -> jax.Array:
  """`sum_j dy[:, cols_j] @ dequant(q[:, cols_j], scale[:, cols_j])^T` over chunks of `c`
  columns of N (a shorter last chunk): a scan with an (M, K) float32 accumulator."""
  m = dy.shape[0]
  k, n = q.shape
  steps, rem = divmod(n, c)
  main = steps * c

  def step(acc: jax.Array, j: jax.Array) -> tuple[jax.Array, None]:
    dyj = jax.lax.dynamic_slice_in_dim(dy, j * c, c, axis=1)
    qj = jax.lax.dynamic_slice_in_dim(q, j * c, c, axis=1)
    sj = jax.lax.dynamic_slice_in_dim(scale, j * c, c, axis=1)
    return acc + _rows(dyj, qj, sj), None

  if steps == 1 and not rem:
    return _rows(dy, q, scale)
  acc, _ = jax.lax.scan(step, jnp.zeros((m, k), jnp.float32), jnp.arange(steps, dtype=jnp.int32))
  if rem:
    acc = acc + _rows(dy[:, main:], q[:, main:], scale[:, main:])
  return acc


def cannot(p: TransposedProblem) -> None:
  """The XLA path runs every problem."""
  del p


def slower(p: TransposedProblem) -> None:
  """Where `implementation=None` ends."""
  del p


def run(dy2d: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """The registry's call: `q8_matmul_t_xla(dy2d, q, scale)`, (m, K) float32."""
  return q8_matmul_t_xla(dy2d, q, scale)


__all__ = ["NAME", "SUMMARY", "cannot", "q8_matmul_t_xla", "run", "slower"]
