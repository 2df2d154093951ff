"""One region of a GGUF tensor, read from the file's bytes only (`GGUFCheckpoint.read_region`).

A Q8_0 tensor is stored as rows of n_in / 32 blocks of 34 bytes, one row per output column N:
a column-parallel shard (N split) is one contiguous run of rows; a row-parallel shard (K
split) is a run of whole blocks in each row. A K range must start and end on a 32-row block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from q8rules.checkpoint._common import CheckpointError, index_slices, normalize_index
from q8rules.checkpoint.gguf.layouts import BLOCK_BYTES, block_dtype
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.q8_0 import BLOCK, Q8Array


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
  bounds = normalize_index(index, q_shape)
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
    sel = blocks[(*index_slices(bounds[:-2]), slice(n0, n1), blk)]  # (*lead, n, nb')
  else:
    sel = blocks[(*index_slices(bounds[:-1]), blk)]  # (*lead, n_out', nb')
  lead, n, nbs = sel.shape[:-2], sel.shape[-2], sel.shape[-1]
  rows_k = aligned_empty((*lead, n, nbs, BLOCK), np.int8)
  np.copyto(rows_k, sel["qs"])
  d = sel["d"]
  if kernel:
    q = aligned_empty((*lead, nbs * BLOCK, n), np.int8)
    np.copyto(q, np.swapaxes(rows_k.reshape(*lead, n, nbs * BLOCK), -1, -2))
    scale = aligned_empty((*lead, nbs, n), scale_dtype)
    np.copyto(scale, np.swapaxes(d, -1, -2))
    axis = len(shape) - 2
  else:
    q = rows_k.reshape(*lead, n, nbs * BLOCK)
    scale = aligned_empty((*lead, n, nbs), scale_dtype)
    np.copyto(scale, d)
    axis = len(shape) - 1
  return Q8Array(q=q, scale=scale, axis=axis, dtype=dtype), sel.size * BLOCK_BYTES


def plain_region(arr: np.ndarray, layout: str, index: Any) -> tuple[np.ndarray, int]:
  """One region of a plain tensor `arr` (numpy order, a view of the file) in `layout`, as a
  native-byte-order copy, and the bytes read. In 'kernel' layout `index` is over the shape
  with the last two axes swapped."""
  kernel = layout == "kernel" and arr.ndim >= 2
  shape = (*arr.shape[:-2], arr.shape[-1], arr.shape[-2]) if kernel else arr.shape
  bounds = normalize_index(index, shape)
  if kernel:
    file_index = (*index_slices(bounds[:-2]), slice(*bounds[-1]), slice(*bounds[-2]))
    src = np.swapaxes(arr[file_index], -1, -2)
  else:
    src = arr[index_slices(bounds)]
  out = aligned_empty(src.shape, src.dtype.newbyteorder("="))
  np.copyto(out, src)
  return out, src.size * src.dtype.itemsize


__all__ = ["plain_region", "q8_region"]
