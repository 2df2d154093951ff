"""'xla': the grouped Q8_0 product in plain XLA on every backend, one (group, row tile) work
item at a time (`groups.work_items`).

A `lax.fori_loop` whose trip count is the number of items in use (a while loop: empty groups
have no item and cost nothing) dequantises the item's expert, (K, N) float32, and dots the
item's row tile with it at `Precision.HIGHEST`, keeping the rows of that group. At most one
expert's float weight exists at a time; an expert whose rows span t row tiles is dequantised t
times (once at decode, where every row fits one tile). The transposed product (the gradient in
x) and the scales' gradient walk the same items.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.ragged_matmul.groups import WorkItems, tiles_of, work_items
from q8rules.kernels.ragged_matmul.problem import RaggedProblem
from q8rules.q8_0 import BLOCK, dequantize_blocks

NAME = "xla"
SUMMARY = "a loop over (expert, row tile) items, one expert dequantised at a time, plain XLA"

MAX_BLOCK_M = 256
"""The most rows one item takes."""

_HIGHEST = jax.lax.Precision.HIGHEST


def block_rows(m: int, experts: int) -> int:
  """Rows per tile for m rows over `experts` groups: the rows an expert gets on average, rounded
  up to 8, at most `MAX_BLOCK_M`. An item dots its whole tile, so a tile much taller than its
  group's rows wastes work: 32 decode rows routed to 32 of 128 experts, (2048, 1536) each, ran
  3.6x faster in tiles of 8 rows than in one tile of 32."""
  rows = -(-m // max(experts, 1))
  return max(8, min(MAX_BLOCK_M, -(-rows // 8) * 8))


def _tiled(a: jax.Array, tiles: int, block_m: int) -> jax.Array:
  """(m, c) -> (tiles * block_m, c) float32, zero rows appended."""
  return jnp.pad(a.astype(jnp.float32), ((0, tiles * block_m - a.shape[0]), (0, 0)))


def _items(group_sizes: jax.Array, m: int, experts: int, block_m: int | None):
  """(rows per tile, tiles, the work items) of m rows over `experts` groups (`block_m` None:
  `block_rows(m, experts)`)."""
  bm = block_m or block_rows(m, experts)
  return bm, tiles_of(m, bm), work_items(group_sizes, m, bm)


def _kept(items: WorkItems, g: jax.Array, t: jax.Array, block_m: int) -> jax.Array:
  """(block_m, 1) bool: which rows of row tile t belong to group g."""
  index = t * block_m + jnp.arange(block_m, dtype=jnp.int32)[:, None]
  return (index >= items.starts[g]) & (index < items.ends[g])


def _walk(items: WorkItems, a: jax.Array, block_m: int, width: int, item_out) -> jax.Array:
  """The sum over the items of `item_out(rows, g)`, the rows of group g kept, placed at the
  item's tile: a (tiles * block_m, width) float32 accumulator; rows (block_m, c) of `a`
  (tiled)."""

  def body(i, acc):
    g, t = items.group[i], items.tile[i]
    rows = jax.lax.dynamic_slice_in_dim(a, t * block_m, block_m)
    old = jax.lax.dynamic_slice_in_dim(acc, t * block_m, block_m)
    new = old + jnp.where(_kept(items, g, t, block_m), item_out(rows, g), 0.0)
    return jax.lax.dynamic_update_slice_in_dim(acc, new, t * block_m, 0)

  acc = jnp.zeros((a.shape[0], width), jnp.float32)
  return jax.lax.fori_loop(0, items.count, body, acc)


def _grouped(
  a: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  group_sizes: jax.Array,
  block_m: int | None,
  transposed: bool,
) -> jax.Array:
  """`out[m] = a[m] @ W[g(m)]`, or `a[m] @ W[g(m)]^T` when `transposed`: (M, N) or (M, K)
  float32, for a (M, K) or (M, N) and W[e] = q[e] (K, N) int8 * scale[e] (K/32, N)."""
  m = a.shape[0]
  bm, tiles, items = _items(group_sizes, m, q.shape[0], block_m)

  def item_out(rows, g):
    w = dequantize_blocks(q[g], scale[g])
    w = w.T if transposed else w
    return jnp.dot(rows, w, precision=_HIGHEST, preferred_element_type=jnp.float32)

  width = q.shape[1] if transposed else q.shape[2]
  return _walk(items, _tiled(a, tiles, bm), bm, width, item_out)[:m]


def ragged_xla(
  x: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  group_sizes: jax.Array,
  *,
  block_m: int | None = None,
) -> jax.Array:
  """`out[m] = x[m] @ (q[g(m)] * scale[g(m)])`, (M, N) float32.

  Args:
    x: (M, K) float32, bfloat16 or float16 (converted to float32, exactly), K a multiple of 32.
    q: (E, K, N) int8.
    scale: (E, K/32, N) float32 or float16.
    group_sizes: (E,) int32, rows per expert in order (rows past their sum get zeros).
    block_m: rows per work item (default `block_rows(M, E)`).
  """
  return _grouped(x, q, scale, group_sizes, block_m, transposed=False)


def ragged_xla_t(
  dy: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  group_sizes: jax.Array,
  *,
  block_m: int | None = None,
) -> jax.Array:
  """The transposed product `dx[m] = dy[m] @ W[g(m)]^T`, (M, K) float32 (the gradient in x),
  dy (M, N); the items and operands as `ragged_xla`'s."""
  return _grouped(dy, q, scale, group_sizes, block_m, transposed=True)


def ragged_xla_dscale(
  x: jax.Array, q: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, block_m: int | None = None
) -> jax.Array:
  """The scales' gradient: `ds[e, b, n] = sum_{m in group e} dy[m, n] sum_i x[m, 32b + i]
  q[e, 32b + i, n]`, (E, K/32, N) float32, for x (M, K), q (E, K, N) int8, dy (M, N)."""
  m = x.shape[0]
  experts, k, n = q.shape
  bm, tiles, items = _items(group_sizes, m, experts, block_m)
  xt, dyt = _tiled(x, tiles, bm), _tiled(dy, tiles, bm)

  def body(i, ds):
    g, t = items.group[i], items.tile[i]
    rows = jnp.where(_kept(items, g, t, bm), jax.lax.dynamic_slice_in_dim(xt, t * bm, bm), 0.0)
    dys = jax.lax.dynamic_slice_in_dim(dyt, t * bm, bm)
    xdy = jnp.dot(rows.T, dys, precision=_HIGHEST, preferred_element_type=jnp.float32)  # (K, N)
    part = (xdy * q[g].astype(jnp.float32)).reshape(k // BLOCK, BLOCK, n).sum(axis=1)
    return ds.at[g].add(part)

  ds = jnp.zeros((experts, k // BLOCK, n), jnp.float32)
  return jax.lax.fori_loop(0, items.count, body, ds)


def cannot(p: RaggedProblem) -> None:
  """The XLA loop runs every problem."""
  del p


def slower(p: RaggedProblem) -> None:
  """The XLA loop is where `implementation=None` ends."""
  del p


def run(x2d, q, scale, group_sizes, platform: str, interpret: bool | None) -> jax.Array:
  """The registry's call: `ragged_xla(x2d, q, scale, group_sizes)`, (m, N) float32."""
  del platform, interpret
  return ragged_xla(x2d, q, scale, group_sizes)


__all__ = [
  "MAX_BLOCK_M",
  "NAME",
  "SUMMARY",
  "block_rows",
  "cannot",
  "ragged_xla",
  "ragged_xla_dscale",
  "ragged_xla_t",
  "run",
  "slower",
]
