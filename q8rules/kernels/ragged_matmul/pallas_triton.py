"""The grouped product on GPU: a Pallas Triton kernel over (column tile, row tile), each
program walking its row tile's work items.

Grid (column tiles j, row tiles t). The work items (`groups.work_items`) list each non-empty
group's row tiles, tile after tile, so row tile t's items are a run [lo[t], hi[t]) of the list;
program (j, t) loops over them (a loop with bounds read from `lo` and `hi`), and for item i
reads its expert g = group[i] straight from the (E, K, N) values and scales (its column tile,
32 rows at a time), folds each Q8_0 block into a (T, tn) float32 sum (one (T, 32) x (32, tn)
`tl.dot` per block, scaled down its columns) and adds that sum into a register accumulator for
the rows in [starts[g], ends[g]). The tile is stored once. Only the routed experts' values and
scales are read, each once per (row tile, column tile); empty groups have no item.

Numerics as the fold's (`kernels/matmul/pallas_triton.py`): bf16/f16 x dots q cast to its
dtype (exact), float32 x at `Precision.HIGHEST` (IEEE, not TF32); float32 scales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from q8rules.kernels.matmul._pallas_compat import pl, triton_compiler_params
from q8rules.kernels.ragged_matmul.groups import grouped_rows, pad_columns, tiles_of, work_items
from q8rules.q8_0 import BLOCK

BLOCK_M = 16
"""Rows of a row tile (Triton's smallest dot M)."""

BLOCK_N = 64
"""The column tile."""

NUM_WARPS = 4
NUM_STAGES = 2


def _kernel(lo_ref, hi_ref, group_ref, starts_ref, ends_ref, x_ref, q_ref, s_ref, o_ref, *,
            precision):  # fmt: skip
  """Program (j, t): x_ref (T, K), q_ref (E, K, tn) int8, s_ref (E, K/32, tn) f32, o_ref (T, tn)."""
  t = pl.program_id(1)
  rows, tn = o_ref.shape
  blocks = s_ref.shape[1]
  row = t * rows + lax.broadcasted_iota(jnp.int32, (rows, tn), 0)

  def item(i, acc):
    g = group_ref[i]

    def fold_block(b, part):
      block_rows = pl.ds(pl.multiple_of(b * BLOCK, BLOCK), BLOCK)
      xb = x_ref[:, block_rows]  # (T, 32)
      qb = q_ref[g, block_rows, :].astype(xb.dtype)  # (32, tn), exact
      dot = jnp.dot(xb, qb, precision=precision, preferred_element_type=jnp.float32)
      return part + dot * s_ref[g, pl.ds(b, 1), :]

    part = lax.fori_loop(0, blocks, fold_block, jnp.zeros((rows, tn), jnp.float32))
    keep = (row >= starts_ref[g]) & (row < ends_ref[g])
    return acc + jnp.where(keep, part, 0.0)

  o_ref[...] = lax.fori_loop(lo_ref[t], hi_ref[t], item, jnp.zeros((rows, tn), jnp.float32))


def ragged_gpu(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  group_sizes: jax.Array,
  *,
  block_m: int = BLOCK_M,
  block_n: int = BLOCK_N,
  interpret: bool = False,
  num_warps: int = NUM_WARPS,
  num_stages: int = NUM_STAGES,
) -> jax.Array:
  """`out[m] = x2d[m] @ (q[g(m)] * scale[g(m)])` with the Triton kernel: (M, N) float32.

  Args:
    x2d, q, scale, group_sizes: (M, K) float32, bfloat16 or float16 (K a multiple of 32); (E,
      K, N) int8; (E, K/32, N) float32 or float16; (E,) int32 rows per expert in order (rows
      past their sum get zeros).
    block_m: rows per tile, a power of two >= 16.
    block_n: the column tile, a power of two >= 16; N is padded to it with zero values and
      scales.
    interpret: Pallas interpret mode (any backend).
    num_warps, num_stages: Triton's launch parameters.
  """
  m, k = x2d.shape
  n = q.shape[2]
  for name, v in (("block_m", block_m), ("block_n", block_n)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"ragged_gpu: {name}={v} is not a power of two >= 16")
  tiles = tiles_of(m, block_m)
  items = work_items(group_sizes, m, block_m)
  index = jnp.arange(items.tile.shape[0], dtype=jnp.int32)
  tile = jnp.where(index < items.count, items.tile, tiles)  # the items in use, by tile
  lo = jnp.searchsorted(tile, jnp.arange(tiles), side="left").astype(jnp.int32)
  hi = jnp.searchsorted(tile, jnp.arange(tiles), side="right").astype(jnp.int32)
  n_pad = -(-n // block_n) * block_n
  q, scale = pad_columns(q, scale, n_pad)
  xt = jnp.pad(x2d, ((0, tiles * block_m - m), (0, 0)))
  precision = jax.lax.Precision.HIGHEST if xt.dtype == jnp.float32 else None
  experts = q.shape[0]
  vector = functools.partial(pl.BlockSpec, index_map=lambda j, t: (0,))
  out = pl.pallas_call(
    functools.partial(_kernel, precision=precision),
    out_shape=jax.ShapeDtypeStruct((tiles * block_m, n_pad), jnp.float32),
    grid=(n_pad // block_n, tiles),
    in_specs=[
      vector((tiles,)),
      vector((tiles,)),
      vector((items.group.shape[0],)),
      vector((experts,)),
      vector((experts,)),
      pl.BlockSpec((block_m, k), lambda j, t: (t, 0)),
      pl.BlockSpec((experts, k, block_n), lambda j, t: (0, 0, j)),
      pl.BlockSpec((experts, k // BLOCK, block_n), lambda j, t: (0, 0, j)),
    ],
    out_specs=pl.BlockSpec((block_m, block_n), lambda j, t: (t, j)),
    compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
    interpret=interpret,
    name="q8_ragged_gpu",
  )(lo, hi, items.group, items.starts, items.ends, xt, q, scale.astype(jnp.float32))
  return grouped_rows(out, m, n, items)


__all__ = ["BLOCK_M", "BLOCK_N", "ragged_gpu"]
