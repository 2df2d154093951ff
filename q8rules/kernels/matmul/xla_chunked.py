"""The XLA Q8_0 product for every shape and backend: a scan over K chunks, or over N chunks
when x has more rows than a K chunk.

Each scan step dequantises one chunk of rows (int8 -> float32 times the scale,
one fusion) and dots it into a float32 accumulator, so no float weight wider
than a chunk ever exists. The scan body is rematerialised, so reverse mode
dequantises each chunk again instead of keeping the whole float weight as a
residual. Why this form, and the forms measured against it: docs/design.md.

With more rows m of x than a K chunk has (prefill, training: m = 512 against a tied head's
32-row chunks, K = 576 and N = 49152), every step would read and write the whole (m, N)
accumulator for a thin dot; there the steps take chunks of N's columns instead (`column_chunk`),
each a whole-K dot into its own (m, cn) part of the output, no accumulator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from q8rules.kernels.problem import Problem
from q8rules.q8_0 import BLOCK, dequantize_blocks

RowsProduct = Callable[[Array, Array, Array], Array]
"""`rows_product(x (M, c), q (c, N), scale (c // 32, N)) -> (M, N) float32`: one chunk's
product (`map_column_chunks` gives it a chunk of N's columns and all of K instead)."""

NAME = "xla"
SUMMARY = "K-chunked dequantise-and-dot in plain XLA, every shape and backend"
ROUNDS_WEIGHT = False
"""Every product is exact; only the float32 accumulation rounds."""

CHUNK_BYTES = 8 << 20
"""Bytes of the float32 chunk one scan step dequantises (see `default_chunk`)."""

MAX_CHUNK = 1024
"""The most weight rows one scan step takes."""

_HIGHEST = jax.lax.Precision.HIGHEST


def default_chunk(m: int, k: int, n: int) -> int:
  """Rows of the weight dequantised per scan step for an (m, K) x (K, N) product.

  About `CHUNK_BYTES` of float32 per step (512 rows at N = 4096), a multiple of
  32 between 32 and `MAX_CHUNK`, and at most half of K so the scan has at least
  two steps (measurements: docs/design.md).
  """
  del m
  rows = CHUNK_BYTES // (4 * max(n, 1)) // BLOCK * BLOCK
  half = k // 2 // BLOCK * BLOCK
  return max(BLOCK, min(rows, MAX_CHUNK, half or k))


COLUMN_ALIGN = 128
"""A column chunk is a multiple of this many columns (or the whole N)."""


def column_chunk(m: int, k: int, n: int) -> int | None:
  """Columns of the weight dequantised per step for an (m, K) x (K, N) product, or None for
  K chunks (`default_chunk`).

  None while m is at most `default_chunk(m, K, N)` (decode: the accumulator is no bigger than
  the chunk). Past that about `CHUNK_BYTES` of float32 per step: a multiple of `COLUMN_ALIGN`
  that divides N if one is within that size (no remainder step), or N itself when the whole
  weight fits.
  """
  if m <= default_chunk(m, k, n):
    return None
  target = max(COLUMN_ALIGN, CHUNK_BYTES // (4 * max(k, 1)) // COLUMN_ALIGN * COLUMN_ALIGN)
  if target >= n:
    return n
  for c in range(target, COLUMN_ALIGN - 1, -COLUMN_ALIGN):
    if n % c == 0:
      return c
  return target


def _chunk_rows(k: int, chunk: int) -> int:
  """`chunk` rounded down to a multiple of 32, at least 32 and at most k."""
  return max(BLOCK, min(chunk, k) // BLOCK * BLOCK)


def _rows_product(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """x (M, r) float32 @ dequantised rows q (r, N) int8 / scale (r/32, N) -> (M, N) float32,
  at full float32 precision."""
  w = dequantize_blocks(q, scale)
  return jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=jnp.float32)


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
      of 32); None picks `column_chunk(M, K, N)` columns per step when it gives some,
      else `default_chunk(M, K, N)` rows. A K (N) that is not a multiple of the chunk
      ends with one smaller chunk.

  Returns:
    (M, N) float32, accumulated in float32.

  The operands are trusted (`q8_matmul` checks them: `problem.check_operands`).
  """
  m, k = x.shape
  n = q.shape[1]
  columns = column_chunk(m, k, n) if chunk is None else None
  if columns is not None:
    return map_column_chunks(x.astype(jnp.float32), q, scale, columns, _rows_product)
  c = _chunk_rows(k, default_chunk(m, k, n) if chunk is None else chunk)
  return scan_row_chunks(x.astype(jnp.float32), q, scale, c, _rows_product)


def map_column_chunks(x: Array, q: Array, scale: Array, c: int, rows_product: RowsProduct) -> Array:
  """`concat_j rows_product(x, q[:, cols_j], scale[:, cols_j])` over chunks of `c` columns of
  N (a shorter last chunk), as a `lax.map` whose body is rematerialised (reverse mode
  dequantises each chunk again). (M, N) float32."""
  m = x.shape[0]
  n = q.shape[1]
  steps, rem = divmod(n, c)
  if steps == 1 and not rem:
    return jax.checkpoint(rows_product, prevent_cse=False)(x, q, scale)
  main = steps * c

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def step(j: jax.Array) -> jax.Array:
    qj = jax.lax.dynamic_slice_in_dim(q, j * c, c, axis=1)
    sj = jax.lax.dynamic_slice_in_dim(scale, j * c, c, axis=1)
    return rows_product(x, qj, sj)

  parts = jax.lax.map(step, jnp.arange(steps, dtype=jnp.int32))  # (steps, M, c)
  out = parts.transpose(1, 0, 2).reshape(m, main)
  if rem:
    last = jax.checkpoint(rows_product, prevent_cse=False)(x, q[:, main:], scale[:, main:])
    out = jnp.concatenate([out, last], axis=1)
  return out


def scan_row_chunks(x: Array, q: Array, scale: Array, c: int, rows_product: RowsProduct) -> Array:
  """`sum_i rows_product(x[:, rows_i], q[rows_i], scale[blocks_i])` over chunks of `c` rows of
  K (a multiple of 32; a shorter last chunk), as a scan whose body is rematerialised, so
  reverse mode recomputes each chunk instead of keeping them all. (M, N) float32."""
  m, k = x.shape
  steps, rem = divmod(k, c)
  main = steps * c
  xs = x[:, :main].reshape(m, steps, c).transpose(1, 0, 2)  # (steps, M, c)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def step(acc: jax.Array, xi_i: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
    xi, i = xi_i
    qi = jax.lax.dynamic_slice_in_dim(q, i * c, c, axis=0)
    si = jax.lax.dynamic_slice_in_dim(scale, i * (c // BLOCK), c // BLOCK, axis=0)
    return acc + rows_product(xi, qi, si), None

  acc = jnp.zeros((m, q.shape[1]), jnp.float32)
  acc, _ = jax.lax.scan(step, acc, (xs, jnp.arange(steps, dtype=jnp.int32)))
  if rem:
    acc = acc + jax.checkpoint(rows_product, prevent_cse=False)(
      x[:, main:], q[main:], scale[main // BLOCK :]
    )
  return acc


def cannot(p: Problem) -> None:
  """The XLA scan runs every problem."""
  del p


def slower(p: Problem) -> None:
  """Nothing is faster everywhere: the XLA scan is where `implementation=None` ends."""
  del p


def run(x2d: jax.Array, q: jax.Array, scale: jax.Array, platform: str, interpret: bool | None):
  """The registry's call: `q8_matmul_xla(x2d, q, scale)`, (m, N) float32."""
  del platform, interpret
  return q8_matmul_xla(x2d, q, scale)
