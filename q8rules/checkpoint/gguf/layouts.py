"""The Q8_0 block format, the tensor types read and written, and the two layouts.

A Q8_0 tensor in a GGUF file is a run of 34-byte blocks (`BLOCK_BYTES`): a
float16 scale `d` then 32 int8 values `qs`, with `w = qs * d`, blocked along
its last numpy axis. `q8_shapes` gives the shapes of the `Q8Array` such a
tensor becomes in each layout ('kernel' or 'gguf'; see `q8rules.checkpoint.gguf`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Literal

import gguf as gguf_lib
import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from q8rules.q8_0 import BLOCK

Q8_0 = GGMLQuantizationType.Q8_0
BLOCK_BYTES = 2 + BLOCK
"""Bytes of one Q8_0 block: float16 `d`, then 32 int8."""

GGML_MAX_DIMS = 4
"""The most dimensions a ggml tensor has."""

Layout = Literal["kernel", "gguf"]
LAYOUTS = ("kernel", "gguf")

PLAIN_TYPES: dict[GGMLQuantizationType, np.dtype] = {
  GGMLQuantizationType.F32: np.dtype(np.float32),
  GGMLQuantizationType.F16: np.dtype(np.float16),
  GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16),
  GGMLQuantizationType.F64: np.dtype(np.float64),
  GGMLQuantizationType.I8: np.dtype(np.int8),
  GGMLQuantizationType.I16: np.dtype(np.int16),
  GGMLQuantizationType.I32: np.dtype(np.int32),
  GGMLQuantizationType.I64: np.dtype(np.int64),
}
"""GGUF tensor types that come back as numpy arrays of these dtypes."""

DTYPE_TO_TYPE: dict[np.dtype, GGMLQuantizationType] = {v: k for k, v in PLAIN_TYPES.items()}
"""The GGUF tensor type an array of each dtype is written as (the inverse of PLAIN_TYPES)."""

SCALE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
"""Dtypes of Q8Array scales read and written (float16 is the file's own)."""


def block_dtype(byteorder: str) -> np.dtype:
  """A Q8_0 block as a packed numpy record: `d` float16 then `qs` 32 int8 (34 bytes).

  byteorder: '<' or '>', the file's byte order of `d`.
  """
  return np.dtype([("d", byteorder + "f2"), ("qs", "i1", (BLOCK,))])


def check_layout(layout: str) -> None:
  """ValueError unless `layout` is 'kernel' or 'gguf'."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_scale_dtype(scale_dtype: Any) -> np.dtype:
  """`scale_dtype` as a numpy dtype; ValueError unless float16 or float32."""
  scale_dtype = np.dtype(scale_dtype)
  if scale_dtype not in SCALE_DTYPES:
    raise ValueError(f"scale_dtype must be float16 or float32, got {scale_dtype}")
  return scale_dtype


def swap_last(shape: tuple[int, ...]) -> tuple[int, ...]:
  """`shape` with its last two axes swapped (unchanged below rank 2)."""
  return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape


def q8_shapes(
  shape: tuple[int, ...], layout: Layout
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
  """(q shape, scale shape, axis) of a Q8_0 tensor of numpy shape `shape` in `layout`."""
  scale_rows = (*shape[:-1], shape[-1] // BLOCK)
  if layout == "kernel" and len(shape) >= 2:
    return swap_last(shape), swap_last(scale_rows), len(shape) - 2
  return shape, scale_rows, len(shape) - 1


@functools.cache
def dequantizable(qtype: GGMLQuantizationType) -> bool:
  """Whether `gguf.quants.dequantize` knows `qtype`: asked of one block of zero bytes
  (it raises NotImplementedError for a type it does not know)."""
  _, type_size = GGML_QUANT_SIZES[qtype]
  try:
    with np.errstate(all="ignore"), warnings.catch_warnings():
      warnings.simplefilter("ignore")
      gguf_lib.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
  except Exception:  # NotImplementedError, or a type that fails on any bytes
    return False
  return True
