"""Reading a tensor shard by shard: each process reads from the file only the byte ranges of
the shards its own devices hold.

A shard is an `index`, a tuple of slices into the value as the checkpoint gives it (layout
'kernel': a Q8_0 matrix as q (..., K, N), blocked along K). A checkpoint's `read_region(name,
index)` reads one region from the file's bytes (GGUF: `q8rules.checkpoint.gguf.regions`, from
the memory map: only the pages of the region are touched); `assemble` builds a (possibly multi-process) `jax.Array` / `Q8Array` from the
regions of the devices this process addresses (`jax.make_array_from_callback`), so no
process materialises another process's shard.

For a GGUF Q8_0 tensor, stored as rows of n_in / 32 blocks of 34 bytes (one row per output
column N): a column-parallel shard (N split) is one contiguous run of rows; a row-parallel
shard (K split) is a run of whole blocks in each row. A K range must start and end on a
32-row block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from q8rules.checkpoint._common import (
  CheckpointError,
  blocked_axis,
  index_slices,
  normalize_index,
  region_of,
)
from q8rules.checkpoint.reader import CheckpointReader, stack
from q8rules.q8_0 import BLOCK, Q8Array

Index = tuple[slice, ...]
"""One shard: a slice per axis of the value (as `jax.make_array_from_callback` gives it)."""


def read_region(ckpt: CheckpointReader, name: str, index: Any) -> Any:
  """`ckpt[name][index]` by the reader's `read_region`; the tensor's file pages are released
  afterwards."""
  value = ckpt.read_region(name, index)
  ckpt.release(name)
  return value


def read_stacked_region(ckpt: CheckpointReader, members: Any, index: Any) -> Any:
  """A region of one tensor (`members` a name) or of per-layer tensors stacked along a new
  leading axis (`members` a list of names, in layer order): `index[0]` picks the layers, the
  rest is each layer's region."""
  if isinstance(members, str):
    return read_region(ckpt, members, index)
  index = tuple(index)
  ((l0, l1),), rest = normalize_index(index[:1], (len(members),)), index[1:]
  return stack([read_region(ckpt, n, rest) for n in members[l0:l1]])


def _check(got: tuple[int, ...], want: tuple[int, ...], what: str, part: str) -> None:
  if tuple(got) != tuple(want):
    raise CheckpointError(f"{what}: the shard read for {part} is {tuple(got)}, not {tuple(want)}")


def assemble(leaf: Any, read: Callable[[Index], Any], what: str) -> Any:
  """The value of a sharded param leaf, each addressable shard read on its own.

  Args:
    leaf: a `jax.ShapeDtypeStruct` with a sharding, or a `Q8Array` of such (q and scale
      split alike; `leaf.axis` the blocked axis).
    read: index over the leaf's (q's) shape -> that region (`Q8Array` / numpy array), from
      the file. Called once per distinct region this process's devices hold (devices that
      hold the same region, e.g. along a replicated axis, share one read).
    what: the tensor and param, for errors.

  Returns:
    A `jax.Array` (or `Q8Array` of them) on the leaf's sharding, scales cast to the leaf's
    scale dtype (float16 -> float32 exactly), float values to its dtype.
  """
  cache: dict[tuple[tuple[int, int], ...], Any] = {}

  def region(bounds: tuple[tuple[int, int], ...]) -> Any:
    if bounds not in cache:
      cache[bounds] = read(index_slices(bounds))
    return cache[bounds]

  if isinstance(leaf, Q8Array):
    q_shape, s_shape = tuple(leaf.q.shape), tuple(leaf.scale.shape)
    axis = blocked_axis(q_shape, s_shape)
    s_dtype = np.dtype(leaf.scale.dtype)

    def q_part(index: Index) -> np.ndarray:
      bounds = normalize_index(index, q_shape)
      got = region(bounds)
      _check(got.q.shape, [b - a for a, b in bounds], what, f"q{index_slices(bounds)}")
      return np.asarray(got.q, np.int8)

    def scale_part(index: Index) -> np.ndarray:
      sb = normalize_index(index, s_shape)
      bounds = tuple(
        (a * BLOCK, min(b * BLOCK, q_shape[axis])) if i == axis else (a, b)
        for i, (a, b) in enumerate(sb)
      )
      got = region(bounds)
      _check(got.scale.shape, [b - a for a, b in sb], what, f"scale{index_slices(sb)}")
      scale = np.asarray(got.scale)
      if scale.dtype != s_dtype:
        new = scale.astype(s_dtype)
        if s_dtype.itemsize < scale.dtype.itemsize and not np.array_equal(new, scale):
          raise CheckpointError(
            f"{what}: the param keeps {s_dtype.name} scales but the tensor's"
            f" {scale.dtype.name} scales are not all {s_dtype.name} values"
          )
        scale = new
      return scale

    q = jax.make_array_from_callback(q_shape, leaf.q.sharding, q_part)
    scale = jax.make_array_from_callback(s_shape, leaf.scale.sharding, scale_part)
    return Q8Array(q=q, scale=scale, axis=leaf.axis, dtype=leaf.dtype)

  shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)

  def part(index: Index) -> np.ndarray:
    bounds = normalize_index(index, shape)
    got = np.asarray(region(bounds))
    _check(got.shape, [b - a for a, b in bounds], what, str(index_slices(bounds)))
    return got.astype(dtype, copy=False)

  return jax.make_array_from_callback(shape, leaf.sharding, part)


__all__ = [
  "Index",
  "assemble",
  "blocked_axis",
  "normalize_index",
  "read_region",
  "read_stacked_region",
  "region_of",
]
