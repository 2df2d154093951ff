"""GGUF tensors into the kernel layout through the native library: Q8_0 rows transposed into
(K, N) int8 values and (K/32, N) float16 scales straight from the file's blocks, and tensors of
GGUF's other types requantized to Q8_0 on the way, in the same pass (`kernels/cpu/repack.h`,
`kernels/cpu/requant_repack.h`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from q8rules.kernels.native import library, threads

REPACK_THREAD_BYTES = 1 << 18
"""A repack splits its work over threads only for at least this many bytes (below it, starting a
thread costs about what it saves): whole tensors to each thread when a call repacks several (a
stack's layers), else the rows of the one tensor."""

Q8_0_TYPE = 8
"""GGML's type id of Q8_0: `repack_q8_transposed`'s default source type."""


def repack_q8_transposed(
  blocks: np.ndarray | Sequence[np.ndarray],
  out: np.ndarray,
  scale_out: np.ndarray | None = None,
  *,
  source_types: int | Sequence[int] = Q8_0_TYPE,
) -> bool:
  """Write the int8 values (and, with `scale_out`, the float16 scales) of GGUF Q8_0 rows into
  the kernel layout, read straight from the file's blocks; False (nothing written) when the
  native library is unavailable here or does not read a source type.

  Args:
    blocks: uint8, C-contiguous: batch x rows rows of nb 34-byte blocks (a little-endian
      float16 scale and 32 int8 values each), `batch` (N = rows, K = nb * 32) tensors as GGUF
      stores them; or a sequence of `batch` such arrays, one tensor each (e.g. a stack's
      layers, each a view of the file's mapping).
    out: (batch, K, rows) int8 whose last axis is contiguous: C-contiguous, or a column
      range of a wider array (`wide[:, :, n0:n0 + rows]`, each (K, rows) a view with
      `wide`'s row stride).
    scale_out: None, or (batch, nb, rows) float16 laid out as `out` (C-contiguous or a column
      range of a wider array): the blocks' scales, transposed, in the same pass.
    source_types: the GGML type id of the tensors' rows, one for all or one a tensor
      (little-endian blocks of that type, K values a row). A tensor of another type than Q8_0
      is requantized to Q8_0 on the way, in the same pass, bit for bit as
      `gguf.quants.quantize(gguf.quants.dequantize(rows), Q8_0)` (its Q8_0 blocks are never
      made whole); that needs `scale_out` and `blocks` as a sequence. A block that decodes to
      a non-finite value gets gguf.quants' NaN or infinite scale: check the scales.

  One native call: its threads (this process's CPUs, for at least `REPACK_THREAD_BYTES` in
  all) start once, and take whole tensors when there are several (runs of 64 rows of any
  tensor when one is requantized).
  """
  lib = library.library()
  if lib is None:
    return False
  batch, k, rows = out.shape
  nb = k // 32
  types = [int(source_types)] * batch if isinstance(source_types, int) else list(source_types)
  requantize = any(t != Q8_0_TYPE for t in types)
  tensor_bytes = {}  # a tensor's bytes, by its type
  for t in set(types):
    values, nbytes = ctypes.c_int64(), ctypes.c_int64()
    if not lib.Q8RequantBlock(ctypes.c_int(t), ctypes.byref(values), ctypes.byref(nbytes)):
      return False
    if k % values.value:
      raise ValueError(
        f"repack_q8_transposed: K = {k} is not whole blocks of GGML type {t}"
        f" ({values.value} values)"
      )
    tensor_bytes[t] = rows * k // values.value * nbytes.value
  sizes_wanted = [tensor_bytes[t] for t in types]
  parts = [blocks] if isinstance(blocks, np.ndarray) else list(blocks)
  sizes = [p.size for p in parts]
  ldd = out.strides[1] if k > 1 else rows
  batch_stride = out.strides[0] if batch > 1 else ldd * k
  if (
    len(types) != batch
    or (requantize and (scale_out is None or len(parts) != batch))
    or any(p.dtype != np.uint8 or not p.flags.c_contiguous for p in parts)
    or out.dtype != np.int8
    or out.strides[2] != 1
    or ldd < rows
    or batch_stride < ldd * k
    or k % 32
    or (len(parts) == 1 and sizes[0] != sum(sizes_wanted))
    or (len(parts) > 1 and sizes != sizes_wanted)
  ):
    raise ValueError(
      f"repack_q8_transposed: expected {batch} tensor(s) of {sizes_wanted[:4]} C-contiguous"
      f" uint8 bytes (GGML types {sorted(set(types))}; scale_out and one array a tensor"
      f" where one is requantized) for an int8 out {out.shape} with contiguous rows, got"
      f" {len(parts)} array(s) of {sizes[:4]} bytes"
      f" ({', '.join(sorted({str(p.dtype) for p in parts}))}) and {out.dtype} (strides"
      f" {out.strides})"
    )
  lds, scale_stride = ldd, batch_stride
  if scale_out is not None:
    lds = scale_out.strides[1] // 2 if nb > 1 else rows
    scale_stride = scale_out.strides[0] // 2 if batch > 1 else lds * nb
    if (
      scale_out.dtype != np.float16
      or scale_out.shape != (batch, nb, rows)
      or scale_out.strides[2] != 2
      or lds < rows
      or scale_stride < lds * nb
    ):
      raise ValueError(
        f"repack_q8_transposed: expected float16 scales {(batch, nb, rows)} with contiguous"
        f" rows, got {scale_out.dtype} {scale_out.shape} (strides {scale_out.strides})"
      )
  if len(parts) == 1:
    starts = [parts[0].ctypes.data + i * sizes_wanted[0] for i in range(batch)]
  else:
    starts = [p.ctypes.data for p in parts]
  n_threads = threads.cpus() if sum(sizes_wanted) >= REPACK_THREAD_BYTES else 1
  ptr, i64 = ctypes.c_void_p, ctypes.c_int64
  strides = (i64(ldd), i64(lds), i64(batch_stride), i64(scale_stride), i64(n_threads))
  sources, dq = (ptr * batch)(*starts), ptr(out.ctypes.data)
  ds = ptr(None if scale_out is None else scale_out.ctypes.data)
  if not requantize:
    lib.Q8RepackKernelBatch(sources, dq, ds, i64(batch), i64(rows), i64(nb), *strides)
    return True
  code = lib.Q8RequantizeKernelBatch(
    (ctypes.c_int * batch)(*types), sources, dq, ds, i64(batch), i64(rows), i64(k), *strides
  )
  if code != 0:
    raise ValueError(f"repack_q8_transposed: the library refused GGML types {types} ({code})")
  return True
