"""The grouped product on TPU: a Mosaic Pallas kernel over (column tile, work item), the items'
groups and row tiles scalar-prefetched into the BlockSpecs' index maps.

Grid (column tiles j, work items i) ('parallel', 'arbitrary'); the items (`groups.work_items`)
list each non-empty group's row tiles, tile after tile. Step (j, i) gets, by the index maps on
the prefetched `group` and `tile` arrays,

  x  (K/32, T, 32)   the item's row tile, as its 32-element blocks (one page per block)
  q  (K, tn) int8    the item's expert's values, one column tile
  d  (K/32, tn) f32  its scales

and adds `sum_b d[b] * (x_b @ q_b)` (one (T, 32) x (32, tn) dot per Q8_0 block) for the rows of
the item's group into the output tile (T, tn), which stays in VMEM while consecutive items
share the tile (zeroed at the tile's first item). Only the routed experts' int8 values and
scales move, each once per (row tile, column tile); items past the count repeat the last one's
blocks (no new copy) and compute nothing.

Numerics as the fold's (`kernels/matmul/pallas_mosaic_tpu.py`): bf16 x dots q cast to bf16
(exact), float32 x at `Precision.HIGHEST`, float16 x as float32; float32 scales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from q8rules.kernels.matmul._pallas_compat import pl, pltpu, tpu_compiler_params
from q8rules.kernels.ragged_matmul.groups import grouped_rows, pad_columns, tiles_of, work_items
from q8rules.q8_0 import BLOCK

LANES = 128
MAX_BLOCK_M = 128
"""The most rows a row tile takes."""

TILE_BYTES = 1 << 20
"""The most bytes of int8 values one step's (K, tn) tile takes (`column_tile`)."""

MAX_UNROLLED_BLOCKS = 64
"""A step's loop over its K/32 blocks is unrolled (static offsets) up to this many blocks."""


def block_rows(m: int, experts: int) -> int:
  """Rows per tile for m rows over `experts` groups: the rows an expert gets on average,
  rounded up to 8 (an f32 sublane tile), at most `MAX_BLOCK_M` (an item dots its whole tile,
  as the XLA path's items do: `xla.block_rows`)."""
  rows = -(-m // max(experts, 1))
  return max(8, min(MAX_BLOCK_M, -(-rows // 8) * 8))


def column_tile(k: int, n: int) -> int:
  """The column tile: the widest of 512/256/128 dividing N rounded up to 128 whose (K, tn) int8
  tile is at most `TILE_BYTES` (128 at least)."""
  n_pad = max(LANES, -(-n // LANES) * LANES)
  for tn in (512, 256, 128):
    if n_pad % tn == 0 and k * tn <= TILE_BYTES:
      return tn
  return LANES


def _kernel(
  group_ref, tile_ref, first_ref, count_ref, starts_ref, ends_ref,
  x_ref, q_ref, s_ref, o_ref, *, precision, unroll,
):  # fmt: skip
  """One (column tile, item) step: x_ref (K/32, T, 32), q_ref (K, tn) int8, s_ref (K/32, tn) f32,
  o_ref (T, tn) f32, accumulated over the tile's items."""
  i = pl.program_id(1)
  live = i < count_ref[0]

  @pl.when(first_ref[i] == 1)
  def _zero():
    o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(live)
  def _item():
    blocks, rows, _ = x_ref.shape

    def fold_block(b, acc):
      start = b * BLOCK if isinstance(b, int) else pl.multiple_of(b * BLOCK, BLOCK)
      xb = x_ref[b]  # (T, 32)
      qb = q_ref[pl.ds(start, BLOCK), :].astype(xb.dtype)  # (32, tn), exact
      part = jnp.dot(xb, qb, precision=precision, preferred_element_type=jnp.float32)
      return acc + part * s_ref[pl.ds(b, 1), :]

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    if unroll:
      for b in range(blocks):
        acc = fold_block(b, acc)
    else:
      acc = jax.lax.fori_loop(0, blocks, fold_block, acc)
    g = group_ref[i]
    row = tile_ref[i] * rows + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
    keep = (row >= starts_ref[g]) & (row < ends_ref[g])
    o_ref[...] += jnp.where(keep, acc, 0.0)


def ragged_tpu(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  group_sizes: jax.Array,
  *,
  block_m: int | None = None,
  block_n: int | None = None,
  interpret: bool = False,
  unroll: bool | None = None,
) -> jax.Array:
  """`out[m] = x2d[m] @ (q[g(m)] * scale[g(m)])` with the Mosaic kernel: (M, N) float32.

  Args:
    x2d: (M, K) float32, bfloat16 or float16, K a multiple of 32.
    q: (E, K, N) int8.
    scale: (E, K/32, N) float32 or float16.
    group_sizes: (E,) int32, rows per expert in order (rows past their sum get zeros).
    block_m: rows per tile, a multiple of 8 (default `block_rows(M, E)`).
    block_n: the column tile, a multiple of 128 (default `column_tile(K, N)`); N is padded
      to it with zero values and scales.
    interpret: Pallas interpret mode (any backend).
    unroll: unroll each step's loop over its Q8_0 blocks (default: not in interpret mode, and
      up to `MAX_UNROLLED_BLOCKS` blocks).
  """
  m, k = x2d.shape
  experts, _, n = q.shape
  bm = block_m or block_rows(m, experts)
  if bm % 8:
    raise ValueError(f"ragged_tpu: block_m={bm} is not a multiple of 8")
  tn = block_n or column_tile(k, n)
  if tn % LANES:
    raise ValueError(f"ragged_tpu: block_n={tn} is not a multiple of {LANES}")
  tiles = tiles_of(m, bm)
  items = work_items(group_sizes, m, bm)
  n_pad = -(-n // tn) * tn
  q, scale = pad_columns(q, scale, n_pad)
  if x2d.dtype == jnp.float16:
    x2d = x2d.astype(jnp.float32)
  xt = jnp.pad(x2d, ((0, tiles * bm - m), (0, 0)))
  xb = xt.reshape(tiles, bm, k // BLOCK, BLOCK).transpose(0, 2, 1, 3)  # (tiles, K/32, T, 32)
  precision = jax.lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
  if unroll is None:
    unroll = not interpret and k // BLOCK <= MAX_UNROLLED_BLOCKS
  prefetch = (
    items.group,
    items.tile,
    items.first,
    items.count.reshape(1),
    items.starts,
    items.ends,
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=(n_pad // tn, items.group.shape[0]),
    in_specs=[
      pl.BlockSpec((None, k // BLOCK, bm, BLOCK), lambda j, i, g, t, *_: (t[i], 0, 0, 0)),
      pl.BlockSpec((None, k, tn), lambda j, i, g, t, *_: (g[i], 0, j)),
      pl.BlockSpec((None, k // BLOCK, tn), lambda j, i, g, t, *_: (g[i], 0, j)),
    ],
    out_specs=pl.BlockSpec((bm, tn), lambda j, i, g, t, *_: (t[i], j)),
  )
  out = pl.pallas_call(
    functools.partial(_kernel, precision=precision, unroll=unroll),
    out_shape=jax.ShapeDtypeStruct((tiles * bm, n_pad), jnp.float32),
    grid_spec=grid_spec,
    compiler_params=tpu_compiler_params(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
    name="q8_ragged_tpu",
  )(*prefetch, xb, q, scale.astype(jnp.float32))
  return grouped_rows(out, m, n, items)


__all__ = ["LANES", "MAX_BLOCK_M", "block_rows", "column_tile", "ragged_tpu"]
