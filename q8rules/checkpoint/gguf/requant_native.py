"""GGUF's other tensor types through the native library (`kernels/cpu/requant.h`): dequantized
to float32 and requantized to Q8_0 GGUF blocks, bit for bit what gguf-py gives
(`gguf.quants.dequantize(data, qtype)` and `gguf.quants.quantize(that, Q8_0)`).

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, F16, BF16 and F32
(`requant_native_types()`, asked of the loaded library). Each function returns None where the
library is unavailable or does not read the type: the caller then uses gguf.quants.

Blocks are read as little-endian (GGUF's default byte order; an array of a big-endian dtype is
refused): a big-endian file's tensors go through gguf.quants. A requantize never holds the
float32 tensor: each thread decodes 4096 values into a buffer of its own, then quantizes them.
Non-finite values do not crash it, and give gguf.quants' blocks (a block with a NaN gets a NaN
scale, one with an infinity an infinite scale, and int8 values 0 where gguf.quants' cast of a
NaN gives 0); the loader refuses such weights before calling.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from q8rules.kernels.native import library
from q8rules.kernels.native import threads as native_threads

Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34
"""Q8_0's values and bytes a block (a float16 scale, then 32 int8)."""

THREAD_VALUES = 1 << 18
"""A call splits its rows over this process's CPUs from this many values on (below it,
starting a thread costs about what it saves)."""

_MAX_TYPE_ID = 64  # GGML type ids asked of the library (ggml's enum stops below it)
_ERRORS = {
  -1: "the library does not read the type",
  -2: "rows of {cols} values are not whole blocks",
}


def _name(qtype: int) -> str:
  """`qtype`'s name in gguf-py (Q4_K), or its id where gguf-py does not know it."""
  try:
    return GGMLQuantizationType(qtype).name
  except ValueError:
    return f"GGML type {qtype}"


@functools.lru_cache(maxsize=4)
def _blocks(lib: ctypes.CDLL) -> dict[int, tuple[int, int]]:
  """The block (values, bytes) of each GGML type id `lib` reads."""
  values, nbytes = ctypes.c_int64(), ctypes.c_int64()
  found = {}
  for qtype in range(_MAX_TYPE_ID):
    if lib.Q8RequantBlock(ctypes.c_int(qtype), ctypes.byref(values), ctypes.byref(nbytes)):
      found[qtype] = (values.value, nbytes.value)
  return found


def _library(qtype: int) -> tuple[ctypes.CDLL, tuple[int, int]] | None:
  """The loaded library and `qtype`'s block (values, bytes), or None when there is no native
  path for it here."""
  lib = library.library()
  if lib is None:
    return None
  block = _blocks(lib).get(int(qtype))
  return None if block is None else (lib, block)


def block_of(qtype: int) -> tuple[int, int]:
  """GGML type `qtype`'s block: (values, bytes), as gguf-py's GGML_QUANT_SIZES has it."""
  return GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]


def requant_native_types() -> frozenset[int]:
  """The GGML type ids the native library dequantizes and requantizes (empty where the library
  is unavailable)."""
  lib = library.library()
  return frozenset() if lib is None else frozenset(_blocks(lib))


def _bytes_of(
  data: np.ndarray, qtype: int, block: tuple[int, int], n_rows: int, n_cols: int, what: str
) -> np.ndarray:
  """`data`'s bytes, C-contiguous, checked to be (n_rows, n_cols) values of `qtype`; a
  ValueError naming the shapes (or the byte order) otherwise."""
  values, nbytes = block
  if n_rows < 0 or n_cols <= 0 or n_cols % values:
    raise ValueError(
      f"{what}: rows of {n_cols} values are not whole blocks of {_name(qtype)}"
      f" ({values} values a block), for {n_rows} rows"
    )
  if data.dtype.byteorder == ">":  # the library runs on x86-64 and aarch64: little-endian
    raise ValueError(
      f"{what}: {data.dtype} data is big-endian; the native code reads little-endian blocks"
      " (a big-endian GGUF file's tensors go through gguf.quants)"
    )
  raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  want = n_rows * (n_cols // values) * nbytes
  if raw.size != want:
    raise ValueError(
      f"{what}: {n_rows} rows of {n_cols} values of {_name(qtype)} are {want} bytes, got"
      f" {raw.size} ({data.dtype} {data.shape})"
    )
  return raw


def _threads(values: int, threads: int | None) -> int:
  """The threads a call of `values` values runs on: `threads`, else this process's CPUs from
  `THREAD_VALUES` on, else one."""
  if threads is not None:
    return max(1, int(threads))
  return native_threads.cpus() if values >= THREAD_VALUES else 1


def _call(
  fn: Callable[..., int],
  qtype: int,
  raw: np.ndarray,
  n_rows: int,
  n_cols: int,
  out: np.ndarray,
  threads: int | None,
) -> None:
  """One of the library's two C functions on checked arguments; a ValueError for its error
  codes (the checks above make them unreachable but for a library that disagrees)."""
  ptr, i64 = ctypes.c_void_p, ctypes.c_int64
  code = fn(
    ctypes.c_int(int(qtype)),
    ptr(raw.ctypes.data),
    i64(n_rows),
    i64(n_cols),
    ptr(out.ctypes.data),
    i64(_threads(n_rows * n_cols, threads)),
  )
  if code != 0:
    detail = _ERRORS.get(code, "error {code}").format(cols=n_cols, code=code)
    raise ValueError(f"native requant of {_name(qtype)}: {detail}")


def dequantize_native(
  data: np.ndarray, qtype: int, shape: tuple[int, ...], *, threads: int | None = None
) -> np.ndarray | None:
  """The tensor's float32 values, as `gguf.quants.dequantize(data, qtype)` gives them (bit
  for bit), in `shape`; None where the native library is unavailable or does not read `qtype`.

  Args:
    data: the tensor's bytes as GGUF stores them: uint8 (or any C-contiguous array, read as
      its bytes, e.g. the float16 array GGUFReader gives for F16), exactly the size `shape`
      takes in `qtype`.
    qtype: its GGML type id (`gguf.GGMLQuantizationType`).
    shape: its shape in numpy order: rows of `shape[-1]` values, a whole number of blocks.
    threads: threads to run on (default: this process's CPUs for at least `THREAD_VALUES`).
  """
  found = _library(qtype)
  if found is None:
    return None
  lib, block = found
  shape = tuple(int(n) for n in shape)
  if not shape:
    raise ValueError(f"dequantize_native: shape () has no rows ({_name(qtype)})")
  n_cols = shape[-1]
  n_rows = math.prod(shape[:-1])
  raw = _bytes_of(data, qtype, block, n_rows, n_cols, f"dequantize_native to {shape}")
  out = np.empty(shape, np.float32)
  _call(lib.Q8Dequantize, qtype, raw, n_rows, n_cols, out, threads)
  return out


def requantize_q8_0_native(
  data: np.ndarray,
  qtype: int,
  n_rows: int,
  n_cols: int,
  out: np.ndarray | None = None,
  *,
  threads: int | None = None,
) -> np.ndarray | None:
  """(n_rows, n_cols) values of GGML type `qtype` as Q8_0 GGUF blocks, as
  `gguf.quants.quantize(gguf.quants.dequantize(data, qtype), Q8_0)` gives them (bit for bit,
  ties and all-zero blocks included); None where the native library is unavailable or does not
  read `qtype`.

  Args:
    data: the tensor's bytes as GGUF stores them (as `dequantize_native` takes them).
    qtype: its GGML type id; Q8_0 itself is read too (its values then requantized).
    n_rows, n_cols: its values as rows of n_cols, a multiple of 32 and of the type's block.
    out: None, or C-contiguous uint8 of n_rows * n_cols / 32 * 34 bytes (any shape) to write.
    threads: threads to run on (default: this process's CPUs for at least `THREAD_VALUES`).

  Returns:
    `out`, or a new (n_rows, n_cols / 32 * 34) uint8 array: each row's 34-byte blocks (a
    float16 scale, then 32 int8 values).
  """
  found = _library(qtype)
  if found is None:
    return None
  lib, block = found
  n_rows, n_cols = int(n_rows), int(n_cols)
  what = f"requantize_q8_0_native of ({n_rows}, {n_cols})"
  if n_cols % Q8_BLOCK:
    raise ValueError(f"{what}: rows of {n_cols} values are not whole Q8_0 blocks of 32")
  raw = _bytes_of(data, qtype, block, n_rows, n_cols, what)
  row_bytes = n_cols // Q8_BLOCK * Q8_BLOCK_BYTES
  if out is None:
    out = np.empty((n_rows, row_bytes), np.uint8)
  elif (
    out.dtype != np.uint8
    or not (out.flags.c_contiguous and out.flags.writeable)
    or out.size != n_rows * row_bytes
  ):
    raise ValueError(
      f"{what}: out must be writable C-contiguous uint8 of {n_rows * row_bytes} bytes"
      f" ({n_rows} rows of {row_bytes}), got {out.dtype} {out.shape}"
    )
  _call(lib.Q8Requantize, qtype, raw, n_rows, n_cols, out, threads)
  return out
