"""The groups of a grouped product as its implementations walk them: where each group's rows
start and end, and the (group, row tile) work items that cover every row once.

Rows are sorted by group; group e owns rows [starts[e], ends[e]). A row tile is `block_m`
consecutive rows. The work items list, group after group, each tile a non-empty group's rows
touch: at most `tiles + E - 1` items (a group ends inside a tile at most once per group), in
order of tiles (a tile's items are consecutive), so a kernel that accumulates a row tile finds
its items one after another. Empty groups have no item: they cost nothing but their place in
the arrays. Items past `count` (the list's static length is the bound) repeat the last item and
must be skipped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """starts, ends (E,) int32: group e's rows are [starts[e], ends[e])."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return ends - group_sizes.astype(jnp.int32), ends


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
  """(m,) int32: each row's group (E for rows past the last group's end)."""
  _, ends = bounds(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def tiles_of(m: int, block_m: int) -> int:
  """Row tiles of `block_m` rows covering m rows (at least one)."""
  return max(1, -(-m // block_m))


def max_items(m: int, experts: int, block_m: int) -> int:
  """The static length of the work list: tiles + E - 1, at most tiles * E."""
  tiles = tiles_of(m, block_m)
  return max(1, min(tiles + experts - 1, tiles * experts))


@dataclasses.dataclass(frozen=True)
class WorkItems:
  """The (group, row tile) items of a grouped product, each array (items,) int32.

  Attributes:
    group: the item's group.
    tile: the item's row tile (rows [tile * block_m, (tile + 1) * block_m)).
    first: 1 where the item is its tile's first (a kernel zeroes the tile there), else 0.
    count: () int32, the items in use; items at or past it repeat the last one.
    starts, ends: (E,) int32, the groups' row bounds.
  """

  group: jax.Array
  tile: jax.Array
  first: jax.Array
  count: jax.Array
  starts: jax.Array
  ends: jax.Array


def work_items(group_sizes: jax.Array, m: int, block_m: int) -> WorkItems:
  """The work items of m rows in tiles of `block_m` rows for `group_sizes` (E,)."""
  experts = group_sizes.shape[0]
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  starts, ends = bounds(sizes)
  tiles = tiles_of(m, block_m)
  first_tile = starts // block_m
  last_tile = jnp.maximum(ends - 1, 0) // block_m
  per_group = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)
  cum = jnp.cumsum(per_group)
  count = cum[-1]
  i = jnp.arange(max_items(m, experts, block_m), dtype=jnp.int32)
  i = jnp.clip(i, 0, jnp.maximum(count - 1, 0))  # items past the count repeat the last one
  group = jnp.minimum(jnp.searchsorted(cum, i, side="right"), experts - 1).astype(jnp.int32)
  tile = first_tile[group] + i - (cum[group] - per_group[group])
  tile = jnp.clip(tile, 0, tiles - 1).astype(jnp.int32)
  previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
  first = (tile != previous).astype(jnp.int32)
  return WorkItems(group, tile, first, count.astype(jnp.int32), starts, ends)


def pad_columns(q: jax.Array, scale: jax.Array, n_pad: int) -> tuple[jax.Array, jax.Array]:
  """q (E, K, N) int8 and scale (E, K/32, N) with zero columns appended up to `n_pad` (zero
  values and zero scales: the pad's sums stay in the pad)."""
  n = q.shape[2]
  if n_pad == n:
    return q, scale
  pad = ((0, 0), (0, 0), (0, n_pad - n))
  return jnp.pad(q, pad), jnp.pad(scale, pad)


def grouped_rows(out: jax.Array, m: int, n: int, items: WorkItems) -> jax.Array:
  """A kernel's padded output (tiles * block_m, n_pad) cut to (m, n), the rows past every
  group's end zeroed."""
  rows = jnp.arange(m, dtype=jnp.int32)[:, None]
  return jnp.where(rows < items.ends[-1], out[:m, :n], 0.0)


__all__ = [
  "WorkItems",
  "bounds",
  "grouped_rows",
  "max_items",
  "pad_columns",
  "row_groups",
  "tiles_of",
  "work_items",
]
