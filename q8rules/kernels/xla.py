"""The XLA Q8_0 product for every shape and backend: a scan over K chunks.

`y = x @ W` with `W = q * d` (Q8_0: int8 values, one scale per 32 rows and
column). Each scan step dequantises one chunk of rows (`c` x N: int8 -> float32
fused with the scale multiply, one XLA loop fusion that streams the int8 from
memory) and multiplies it into a float32 accumulator with one dot, so no float
weight wider than a chunk ever exists. Pure jnp/lax: the same code runs on
TPU and GPU.

Why this form. Measured on the 2-core AMD EPYC (jax 0.10.2, K = N = 4096,
m = 1, float32 x, every call reading its weight from DRAM; medians in ms, the
same session, the machine in a slower state than for `benchmarks/RESULTS.md`,
where this path takes 1.4 ms):

  dequantise the whole weight, then one dot                          21.4
  this scan, 256 / 512 / 1024 rows a step                  1.98 / 2.04 / 2.45
  fold as a per-step batched dot (p[b] = x[b] q[b], y = sum d[b] p[b])  6.4
  fold as a reduce fusion inside the scan                              54
  x * q * d summed as one reduce (YNN), per 512-row step / whole K   4.0 / 24.9
  the chunks unrolled in Python instead of a scan                      20.3
  two chunks per step; the N columns split in two per step       2.33 / 2.87
  pipelined: dequantise chunk i+1 in the carry while dotting chunk i    5.8
  touching chunk i+1 (a strided read) while dotting chunk i            2.54
  m = 1 padded to 2 rows (the dot becomes a YNNPACK GEMM)              2.12
  two independent scans over column halves                             3.05

XLA:CPU never fuses the int8 -> float32 conversion into a dot (its own m = 1
dot emitter and YNNPACK's dot fusions take only float operands), and its
reductions of a broadcast product run 2-800x slower than a dot (YNNPACK's
reduce fusions are pathological when x is broadcast along N: 1.9 s for one
4096 x 4096 product), so "dequantise a cache-sized chunk, then dot" is the
fastest pure-XLA form on CPU. The pipelined variant loses to XLA's copy
insertion (the carried chunk is copied every step), and prefetching never
overlaps the dot: XLA:CPU runs a while body of at most 8 thunks in order, and
in a bigger body buffer reuse made the dot wait for the prefetch. The cost is
the float32 round trip of each chunk through the L3 (4 bytes written and 4
read per weight) on top of the DRAM read of the int8: about 12 GB/s on the Q8
bytes at m = 1, a third of the machine's read bandwidth.

Chunk size (`default_chunk`): about 8 MiB of float32 per step, independent of
M; see there.

Gradients: the scan body is rematerialised (`jax.checkpoint`), so reverse mode
dequantises each chunk again instead of saving every chunk (which would stack
the whole float weight as a residual). The product is linear in x, so
`jax.grad` w.r.t. x computes `dy @ W^T` chunk by chunk; `jax.jvp` and
`jax.vmap` work as usual.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from q8rules.q8_0 import BLOCK

CHUNK_BYTES = 8 << 20
"""Bytes of the float32 chunk one scan step dequantises (see `default_chunk`)."""

MAX_CHUNK = 1024
"""The most weight rows one scan step takes."""

_HIGHEST = jax.lax.Precision.HIGHEST


def default_chunk(m: int, k: int, n: int) -> int:
  """Rows of the weight dequantised per scan step for an (m, K) x (K, N) product.

  About `CHUNK_BYTES` (8 MiB) of float32 per step: 512 rows at N = 4096, 256 at
  N = 8192, a multiple of 32 between 32 and `MAX_CHUNK` rows (and at most K).
  Measured on the 2-core EPYC (ms, weights from DRAM), rows per step:

    K = N = 4096, m = 1:   128: 2.98  256: 1.70  512: 1.55  1024: 1.88 (fastest call)
    K = N = 4096, m = 8:   256: 4.3   512: 3.0   1024: 3.9   2048: 16.3
    K = N = 4096, m = 64:  256: 15.0  512: 13.4  1024: 15.3  2048: 24.9
    K = N = 8192, m = 1:   128: 9.0   256: 8.1   512: 9.7   1024: 23.0
    K = N = 8192, m = 8:   256: 13.3  512: 17.5  1024: 38.0

  Smaller steps pay a thread-pool wake-up (~20 us) and a cold DRAM stream per
  step; 16 MiB steps stop sharing the L3 with the int8 stream. M does not
  change the choice.

  At most half of K, so the scan has at least two steps: a weight dequantised
  in one piece (a one-step scan) ran 6-8x slower inside a whole model (the
  built-in decoder's decode step: 17.7 ms against 2.2 ms with two steps, whose
  weights are 512-1408 rows), though not much slower alone.
  """
  del m
  rows = CHUNK_BYTES // (4 * max(n, 1)) // BLOCK * BLOCK
  half = k // 2 // BLOCK * BLOCK
  return max(BLOCK, min(rows, MAX_CHUNK, half or k))


def _chunk_rows(k: int, chunk: int) -> int:
  """`chunk` rounded down to a multiple of 32, at least 32 and at most k."""
  return max(BLOCK, min(chunk, k) // BLOCK * BLOCK)


def _dequantize_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
  """`q * d` for rows of a Q8_0 weight: q (r, N) int8, scale (r/32, N) -> (r, N) float32."""
  r, n = q.shape
  w = q.reshape(r // BLOCK, BLOCK, n).astype(jnp.float32) * scale.astype(jnp.float32)[:, None, :]
  return w.reshape(r, n)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
  """x (M, r) float32 @ w (r, N) float32 -> (M, N) float32, full float32 precision."""
  return jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _rows_product(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """x (M, r) float32 @ dequantised rows q (r, N) int8 / scale (r/32, N) -> (M, N) float32."""
  return _dot(x, _dequantize_rows(q, scale))


def q8_matmul_xla(
  x: jax.Array, q: jax.Array, scale: jax.Array, *, chunk: int | None = None
) -> jax.Array:
  """`x @ (q * scale)` in K chunks.

  Args:
    x: (M, K) float32, bfloat16 or float16 activations (converted to float32,
      exactly).
    q: (K, N) int8 Q8_0 values, K a multiple of 32.
    scale: (K/32, N) float32 or float16 Q8_0 scales.
    chunk: weight rows dequantised per scan step (rounded down to a multiple
      of 32); None picks `default_chunk(M, K, N)`. A K that is not a multiple
      of the chunk ends with one smaller chunk.

  Returns:
    (M, N) float32, accumulated in float32.
  """
  m, k = x.shape
  n = q.shape[1]
  if q.shape[0] != k or scale.shape != (k // BLOCK, n) or k % BLOCK:
    raise ValueError(
      f"q8_matmul_xla: x {x.shape}, q {q.shape} and scale {scale.shape} do not fit"
      f" (expected q (K, N), scale (K/32, N), K a multiple of {BLOCK})"
    )
  c = _chunk_rows(k, default_chunk(m, k, n) if chunk is None else chunk)
  steps, rem = divmod(k, c)
  x = x.astype(jnp.float32)
  main = steps * c
  xs = x[:, :main].reshape(m, steps, c).transpose(1, 0, 2)  # (steps, M, c)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def step(acc: jax.Array, xi_i: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
    xi, i = xi_i
    qi = jax.lax.dynamic_slice_in_dim(q, i * c, c, axis=0)
    si = jax.lax.dynamic_slice_in_dim(scale, i * (c // BLOCK), c // BLOCK, axis=0)
    return acc + _rows_product(xi, qi, si), None

  acc = jnp.zeros((m, n), jnp.float32)
  acc, _ = jax.lax.scan(step, acc, (xs, jnp.arange(steps, dtype=jnp.int32)))
  if rem:
    acc = acc + jax.checkpoint(_rows_product, prevent_cse=False)(
      x[:, main:], q[main:], scale[main // BLOCK :]
    )
  return acc
