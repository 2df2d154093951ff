"""Reading a tensor shard by shard: each process reads from the file only the byte ranges of
the shards its own devices hold.

A shard is an `index`, a tuple of slices into the value as the checkpoint gives it (layout
'kernel': a Q8_0 matrix as q (..., K, N), blocked along K). `q8_region` and `plain_region`
read one region of a tensor from the file's bytes (a memory map: only the pages of the region
are touched); `assemble` builds a (possibly multi-process) `jax.Array` / `Q8Array` from the
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

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf.layouts import BLOCK_BYTES, block_dtype
from q8rules.q8_0 import BLOCK, Q8Array

Index = tuple[slice, ...]
"""One shard: a slice per axis of the value (as `jax.make_array_from_callback` gives it)."""


def normalize(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  """`index` (slices, maybe fewer than axes) as (start, stop) per axis of `shape`; steps of 1."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
  out = []
  for s, size in zip(index, shape, strict=True):
    start, stop, step = s.indices(size)
    if step != 1:
      raise ValueError(f"a shard index must have steps of 1, got {s}")
    out.append((start, max(start, stop)))
  return tuple(out)


def blocked_axis(q_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int:
  """The axis a Q8Array is blocked along, from its shapes (scale's is q's divided by 32):
  stacked params keep the per-layer `axis` field, so the field alone does not say."""
  diff = [i for i, (a, b) in enumerate(zip(q_shape, scale_shape, strict=True)) if a != b]
  if len(diff) != 1 or q_shape[diff[0]] != scale_shape[diff[0]] * BLOCK:
    raise CheckpointError(f"a Q8Array of q {q_shape} and scale {scale_shape} is not Q8_0-shaped")
  return diff[0]


def _slices(bounds: tuple[tuple[int, int], ...]) -> Index:
  return tuple(slice(a, b) for a, b in bounds)


def q8_region(
  data: np.ndarray,
  shape: tuple[int, ...],
  byteorder: str,
  scale_dtype: np.dtype,
  layout: str,
  dtype: np.dtype,
  index: Any,
) -> tuple[Q8Array, int]:
  """One region of a Q8_0 tensor as a `Q8Array`, and the file bytes it was read from.

  Args:
    data: the tensor's bytes (uint8, a view of the mapped file).
    shape: its numpy-order shape `[*lead, n_out, n_in]`.
    byteorder, scale_dtype, layout, dtype: as `GGUFCheckpoint`.
    index: slices over q's shape in `layout` ('kernel': (*lead, K=n_in, N=n_out); 'gguf':
      (*lead, n_out, n_in)); the K (n_in) range must fall on 32-row blocks.

  Returns:
    (Q8Array with q int8 and scale `scale_dtype` of the region's shapes, bytes read).
  """
  rows, n_in = shape[:-1], shape[-1]
  nb = n_in // BLOCK
  blocks = data.reshape(-1).view(block_dtype(byteorder)).reshape(*rows, nb)
  kernel = layout == "kernel" and len(shape) >= 2
  q_shape = (*shape[:-2], n_in, shape[-2]) if kernel else tuple(shape)
  bounds = normalize(index, q_shape)
  k_axis = len(shape) - 2 if kernel else len(shape) - 1
  k0, k1 = bounds[k_axis]
  if k0 % BLOCK or (k1 % BLOCK and k1 != n_in):
    raise CheckpointError(
      f"rows {k0}:{k1} of K={n_in} cut a {BLOCK}-row Q8_0 block (a shard's K range must"
      f" start and end on a multiple of {BLOCK})"
    )
  blk = slice(k0 // BLOCK, -(-k1 // BLOCK))
  if kernel:
    (n0, n1) = bounds[-1]
    sel = blocks[(*_slices(bounds[:-2]), slice(n0, n1), blk)]  # (*lead, n, nb')
  else:
    sel = blocks[(*_slices(bounds[:-1]), blk)]  # (*lead, n_out', nb')
  lead, n, nbs = sel.shape[:-2], sel.shape[-2], sel.shape[-1]
  rows_k = np.empty((*lead, n, nbs, BLOCK), np.int8)
  np.copyto(rows_k, sel["qs"])
  d = sel["d"]
  if kernel:
    q = np.ascontiguousarray(np.swapaxes(rows_k.reshape(*lead, n, nbs * BLOCK), -1, -2))
    scale = np.empty((*lead, nbs, n), scale_dtype)
    np.copyto(scale, np.swapaxes(d, -1, -2))
    axis = len(shape) - 2
  else:
    q = rows_k.reshape(*lead, n, nbs * BLOCK)
    scale = np.empty((*lead, n, nbs), scale_dtype)
    np.copyto(scale, d)
    axis = len(shape) - 1
  return Q8Array(q=q, scale=scale, axis=axis, dtype=dtype), sel.size * BLOCK_BYTES


def plain_region(arr: np.ndarray, layout: str, index: Any) -> tuple[np.ndarray, int]:
  """One region of a plain tensor `arr` (numpy order, a view of the file) in `layout`, as a
  native-byte-order copy, and the bytes read. In 'kernel' layout `index` is over the shape
  with the last two axes swapped."""
  kernel = layout == "kernel" and arr.ndim >= 2
  shape = (*arr.shape[:-2], arr.shape[-1], arr.shape[-2]) if kernel else arr.shape
  bounds = normalize(index, shape)
  if kernel:
    file_index = (*_slices(bounds[:-2]), slice(*bounds[-1]), slice(*bounds[-2]))
    src = np.swapaxes(arr[file_index], -1, -2)
  else:
    src = arr[_slices(bounds)]
  out = np.empty(src.shape, src.dtype.newbyteorder("="))
  np.copyto(out, src)
  return out, src.size * src.dtype.itemsize


def region_of(value: Any, index: Any) -> Any:
  """A region of a value already read (a Q8Array: `index` over q; its scale rows follow)."""
  if isinstance(value, Q8Array):
    bounds = normalize(index, tuple(value.q.shape))
    axis = blocked_axis(tuple(value.q.shape), tuple(value.scale.shape))
    sb = tuple(
      (a // BLOCK, -(-b // BLOCK)) if i == axis else (a, b) for i, (a, b) in enumerate(bounds)
    )
    return Q8Array(
      q=np.asarray(value.q)[_slices(bounds)],
      scale=np.asarray(value.scale)[_slices(sb)],
      axis=value.axis,
      dtype=value.dtype,
    )
  value = np.asarray(value)
  return value[_slices(normalize(index, value.shape))]


def read_region(ckpt: Any, name: str, index: Any) -> Any:
  """`ckpt[name][index]`: by `ckpt.read_region` where it has one, else read whole and sliced.
  The tensor's file pages are released afterwards (`ckpt.release`, where it has one)."""
  reader = getattr(ckpt, "read_region", None)
  value = reader(name, index) if callable(reader) else region_of(ckpt[name], index)
  release = getattr(ckpt, "release", None)
  if callable(release):
    release(name)
  return value


def read_stacked_region(ckpt: Any, members: Any, index: Any) -> Any:
  """A region of one tensor (`members` a name) or of per-layer tensors stacked along a new
  leading axis (`members` a list of names, in layer order): `index[0]` picks the layers, the
  rest is each layer's region."""
  if isinstance(members, str):
    return read_region(ckpt, members, index)
  index = tuple(index)
  ((l0, l1),), rest = normalize(index[:1], (len(members),)), index[1:]
  parts = [read_region(ckpt, n, rest) for n in members[l0:l1]]
  if parts and isinstance(parts[0], Q8Array):
    return Q8Array(
      q=np.stack([p.q for p in parts]),
      scale=np.stack([p.scale for p in parts]),
      axis=parts[0].axis,  # as StackedTensors stacks (the blocked axis is found from the shapes)
      dtype=parts[0].dtype,
    )
  return np.stack([np.asarray(p) for p in parts])


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
      cache[bounds] = read(_slices(bounds))
    return cache[bounds]

  if isinstance(leaf, Q8Array):
    q_shape, s_shape = tuple(leaf.q.shape), tuple(leaf.scale.shape)
    axis = blocked_axis(q_shape, s_shape)
    s_dtype = np.dtype(leaf.scale.dtype)

    def q_part(index: Index) -> np.ndarray:
      bounds = normalize(index, q_shape)
      got = region(bounds)
      _check(got.q.shape, [b - a for a, b in bounds], what, f"q{_slices(bounds)}")
      return np.asarray(got.q, np.int8)

    def scale_part(index: Index) -> np.ndarray:
      sb = normalize(index, s_shape)
      bounds = tuple(
        (a * BLOCK, min(b * BLOCK, q_shape[axis])) if i == axis else (a, b)
        for i, (a, b) in enumerate(sb)
      )
      got = region(bounds)
      _check(got.scale.shape, [b - a for a, b in sb], what, f"scale{_slices(sb)}")
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
    bounds = normalize(index, shape)
    got = np.asarray(region(bounds))
    _check(got.shape, [b - a for a, b in bounds], what, str(_slices(bounds)))
    return got.astype(dtype, copy=False)

  return jax.make_array_from_callback(shape, leaf.sharding, part)


__all__ = [
  "Index",
  "assemble",
  "normalize",
  "plain_region",
  "q8_region",
  "read_region",
  "read_stacked_region",
  "region_of",
]
