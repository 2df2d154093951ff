"""The fold on TPU: a Mosaic Pallas kernel for decode-shaped Q8_0 products.

`y = x @ W` for x (m, K), m <= 8, and a Q8_0 weight W = q * d (q int8 (K, N),
d float32 (K/32, N), one scale per 32-row block of each column).

Grid (column tiles j, K steps k), ('parallel', 'arbitrary'). Step (j, k) gets

  x   (tk/32, 8, 32)  the K step's 32-element blocks of the 8 (padded) rows:
                      x is read as the K/32 x 32 matrix of its blocks, one
                      page per row (`_blocked_rows`)
  q   (tk, tn) int8   the int8 tile (tk = 1024 rows when K allows)
  d   (tk/32, tn) f32 the tile row of scales

and folds its tk/32 Q8_0 blocks into an fp32 carry in VMEM:

  acc[r, n] += sum_b d[b, n] * sum_i x[r, 32b + i] * q[32b + i, n]

(one (8, 32) x (32, tn) dot per Q8_0 block, scaled down its columns), writing
`acc` out at the last K step. All 8 rows run against the same int8 and scale
pages: the weight moves once for the batch.

Numerics: bf16 activations are dotted with q cast to bf16 (exact: |q| <= 127)
with fp32 accumulation, so each product is exact; float32 activations use
`Precision.HIGHEST` (Mosaic's fp32 contraction); float16 activations are cast
to float32 first (exact). Scales are float32 (float16 scales are upcast).

Block shapes and Mosaic's tiling ((8, 128) f32, (16, 128) bf16, (32, 128) int8
on the last two dims, unless a block spans its whole dim):
  x  (tk/32, 8, 32): (8, 32) spans the padded rows and one 32-element block.
  q  (tk, tn) of the (K/tk, tk, N) view: tk a multiple of 32, tn of 128.
  d  (tk/32, tn) of the (K/tk, tk/32, N) view: tk/32 spans its dim.
K that is not a multiple of 1024 takes a smaller K step rather than zero rows:
tk is the largest multiple of 32 that divides K and is at most 1024, so the
weight is never copied to pad K (the (K/tk, tk, N) view is a free reshape; the
scale view is one when tk is a multiple of 256). N must be a multiple of the
column tile (`column_tile`): `q8rules.kernels.matmul.fold.q8_fold` pads the columns
with zero values and zero scales, whose sums land only in the result's pad.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels.matmul._pallas_compat import pl, pltpu, tpu_compiler_params
from q8rules.q8_0 import BLOCK

TILE_ROWS = 8
"""Activation rows one call folds (an f32 sublane tile); m <= 8, padded to 8."""

MAX_BLOCK_K = 1024
"""Rows of a full K step: 32 Q8_0 blocks, one (8, 128) tile row of f32 scales."""

LANES = 128
COLUMN_TILES = (1024, 512, 256, 128)
"""Column tiles tried, widest first (`column_tile`)."""


def block_k(k: int) -> int:
  """Rows per K step: the largest multiple of 32 dividing `k` that is <= 1024."""
  if k <= 0 or k % BLOCK:
    raise ValueError(f"K={k} is not a positive multiple of {BLOCK}")
  g = min(k // BLOCK, MAX_BLOCK_K // BLOCK)
  while (k // BLOCK) % g:
    g -= 1
  return g * BLOCK


def column_tile(n: int) -> int:
  """The column tile for N columns: the widest of 1024/512/256/128 that divides N
  rounded up to 128, keeping at least two column tiles (for the two TensorCores
  a 'parallel' axis is split over on v4/v5p/v7) when N allows."""
  n_pad = max(LANES, -(-n // LANES) * LANES)
  for tn in COLUMN_TILES:
    if n_pad % tn == 0 and (n_pad // tn >= 2 or tn == LANES):
      return tn
  return LANES


def _fold_kernel(x_ref, q_ref, s_ref, o_ref, acc_ref, *, precision, unroll):
  """One (column tile, K step) of the fold.

  x_ref (tk/32, 8, 32) f32|bf16; q_ref (tk, tn) int8; s_ref (tk/32, tn) f32;
  o_ref (8, tn) f32; acc_ref VMEM (8, tn) f32, carried over the K steps.
  """
  k = pl.program_id(1)

  @pl.when(k == 0)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def fold_block(b, acc):  # b: the Q8_0 block within the step, int or traced
    start = b * BLOCK if isinstance(b, int) else pl.multiple_of(b * BLOCK, BLOCK)
    xb = x_ref[b]  # (8, 32)
    qb = q_ref[pl.ds(start, BLOCK), :].astype(xb.dtype)  # (32, tn), exact
    part = jnp.dot(xb, qb, precision=precision, preferred_element_type=jnp.float32)
    return acc + part * s_ref[pl.ds(b, 1), :]  # fold the block down its columns

  acc = acc_ref[...]
  if unroll:  # static offsets for Mosaic
    for b in range(x_ref.shape[0]):
      acc = fold_block(b, acc)
  else:  # one traced body: what interpret mode compiles (~3x faster on CPU)
    acc = jax.lax.fori_loop(0, x_ref.shape[0], fold_block, acc)
  acc_ref[...] = acc

  @pl.when(k == pl.num_programs(1) - 1)
  def _write():
    o_ref[...] = acc_ref[...]


def _blocked_rows(x2d: jax.Array) -> jax.Array:
  """x (m, K), m <= 8 -> (K/32, 8, 32): rows padded with zeros to 8, each row's K
  split into its 32-element blocks, blocks leading. float16 becomes float32."""
  m, k = x2d.shape
  if x2d.dtype == jnp.float16:
    x2d = x2d.astype(jnp.float32)
  x8 = jnp.pad(x2d, ((0, TILE_ROWS - m), (0, 0)))
  return x8.reshape(TILE_ROWS, k // BLOCK, BLOCK).transpose(1, 0, 2)


def fold_tpu(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  *,
  block_n: int | None = None,
  interpret: bool = False,
  unroll: bool | None = None,
) -> jax.Array:
  """`x2d @ (q * scale)` with the Mosaic fold kernel.

  Args:
    x2d: (m, K) float32, bfloat16 or float16 activations, 1 <= m <= 8.
    q: (K, N) int8, K a multiple of 32, N a multiple of `block_n`.
    scale: (K/32, N) float32 or float16.
    block_n: the column tile, a multiple of 128 (default `column_tile(N)`).
    interpret: run the kernel in Pallas interpret mode (any backend).
    unroll: unroll the loop over a step's Q8_0 blocks (static offsets); default
      `not interpret`: unrolled on TPU, rolled in interpret mode.

  Returns:
    (m, N) float32.
  """
  m, k = x2d.shape
  n = q.shape[1]
  if not 1 <= m <= TILE_ROWS:
    raise ValueError(f"fold_tpu: m={m} rows; the TPU fold takes 1 to {TILE_ROWS}")
  tk = block_k(k)
  tn = block_n or column_tile(n)
  if tn % LANES or n % tn:
    raise ValueError(
      f"fold_tpu: N={n} must be a multiple of the column tile {tn}, itself a multiple of"
      f" {LANES} (pad the columns with zero values and scales; see fold.q8_fold)"
    )
  steps = k // tk
  xb = _blocked_rows(x2d)
  q3 = q.reshape(steps, tk, n)
  s3 = scale.astype(jnp.float32).reshape(steps, tk // BLOCK, n)
  precision = jax.lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
  unroll = not interpret if unroll is None else unroll
  cost = pl.CostEstimate(
    flops=2 * TILE_ROWS * k * n + 2 * TILE_ROWS * (k // BLOCK) * n,
    transcendentals=0,
    bytes_accessed=q.size
    + s3.size * 4
    + xb.size * np.dtype(xb.dtype).itemsize * (n // tn)
    + TILE_ROWS * n * 4,
  )
  out = pl.pallas_call(
    functools.partial(_fold_kernel, precision=precision, unroll=unroll),
    out_shape=jax.ShapeDtypeStruct((TILE_ROWS, n), jnp.float32),
    grid=(n // tn, steps),
    in_specs=[
      pl.BlockSpec((tk // BLOCK, TILE_ROWS, BLOCK), lambda j, kk: (kk, 0, 0)),
      pl.BlockSpec((None, tk, tn), lambda j, kk: (kk, 0, j)),
      pl.BlockSpec((None, tk // BLOCK, tn), lambda j, kk: (kk, 0, j)),
    ],
    out_specs=pl.BlockSpec((TILE_ROWS, tn), lambda j, kk: (0, j)),
    scratch_shapes=[pltpu.VMEM((TILE_ROWS, tn), jnp.float32)],
    compiler_params=tpu_compiler_params(dimension_semantics=("parallel", "arbitrary")),
    cost_estimate=cost,
    interpret=interpret,
    name="q8_fold_tpu",
  )(xb, q3, s3)
  return out[:m]


__all__ = ["TILE_ROWS", "MAX_BLOCK_K", "block_k", "column_tile", "fold_tpu"]
