"""Opening a GGUF file: its header parsed, each tensor's place in the file checked, its bytes mapped.

`open_file(path)` maps the file once (`mmap`), parses the header from the mapping
(`parse.parse_header`), checks what llama.cpp's `gguf_init_from_file` checks (each tensor
starts where the previous one ends, padded to the alignment; its bytes lie inside the file;
its rows are whole blocks of its type), naming the file and the tensor, and gives each
tensor a numpy view of its bytes in the mapping.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf.parse import Header, TensorInfo, parse_header


def check_tensor_infos(
  path: Path, infos: list[TensorInfo], start: int, alignment: int, file_size: int
) -> None:
  """Raise CheckpointError naming the first tensor whose bytes do not fit its shape and type.

  start: file offset of the data section; alignment: the file's data alignment.
  """
  expected = 0
  prev: tuple[str, str, tuple[int, ...], int] | None = None
  for name, type_id, shape, off in infos:
    try:
      qtype = GGMLQuantizationType(type_id)
    except ValueError:
      raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    what = f"tensor {name!r} ({qtype.name}, shape {shape})"
    if shape and shape[-1] % block:
      raise CheckpointError(
        f"{path}: {what}: rows of {shape[-1]} values are not a whole number of"
        f" {qtype.name} blocks of {block}"
      )
    nbytes = math.prod(shape) // block * type_size
    if off != expected:
      if prev is None:
        raise CheckpointError(
          f"{path}: {what} starts at data offset {off}, expected {expected}: corrupt tensor table"
        )
      p_name, p_type, p_shape, p_bytes = prev
      raise CheckpointError(
        f"{path}: the byte count of tensor {p_name!r} does not match its shape and type:"
        f" as {p_type} of shape {p_shape} it takes {p_bytes} bytes (padded: it ends at data"
        f" offset {expected}), but the next tensor {name!r} starts at data offset {off}"
      )
    end = start + off + nbytes
    if end > file_size:
      raise CheckpointError(
        f"{path}: {what}: its {nbytes} bytes at file offset {start + off} run past the end"
        f" of the file ({file_size} bytes, {end - file_size} missing): the file is truncated,"
        " or the tensor's shape does not match its data"
      )
    expected = off + -(-nbytes // alignment) * alignment
    prev = (name, qtype.name, shape, nbytes)


_ITEM_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
  GGMLQuantizationType.F16: np.float16,
  GGMLQuantizationType.F32: np.float32,
  GGMLQuantizationType.F64: np.float64,
  GGMLQuantizationType.I8: np.int8,
  GGMLQuantizationType.I16: np.int16,
  GGMLQuantizationType.I32: np.int32,
  GGMLQuantizationType.I64: np.int64,
}
"""The types whose bytes are viewed as their values; all others (BF16 too) as uint8 blocks."""


class Tensor(NamedTuple):
  """One tensor of an open file.

  name: its name; tensor_type: its ggml type; shape: numpy order (ggml's `ne` reversed);
  data_offset: file offset of its first byte; data: a read-only view of its bytes in the
  file's mapping, as gguf-py's reader views them: for F16, F32, F64 and I8..I64 of shape
  `shape` and that dtype in the file's byte order; for the block types (BF16 and the
  quantized ones) uint8 of shape `(*shape[:-1], bytes of a row)`.
  """

  name: str
  tensor_type: GGMLQuantizationType
  shape: tuple[int, ...]
  data_offset: int
  data: np.ndarray


class GGUFFile(NamedTuple):
  """An open GGUF file: its `header`, its `mapping` (the whole file, read-only) and its
  `tensors` by name in file order, each viewing the mapping."""

  path: Path
  header: Header
  mapping: mmap.mmap
  tensors: dict[str, Tensor]


def _tensor(info: TensorInfo, data_start: int, file: np.ndarray, byteorder: str) -> Tensor:
  """The tensor `info` describes: its bytes in `file` (uint8, the whole mapping) viewed
  as gguf-py's reader views them."""
  qtype = GGMLQuantizationType(info.type_id)
  block, type_size = GGML_QUANT_SIZES[qtype]
  shape = info.shape
  item = _ITEM_DTYPES.get(qtype)
  if item is not None:
    dtype, view_shape = np.dtype(item).newbyteorder(byteorder), shape
  else:
    dtype = np.dtype(np.uint8)
    view_shape = (*shape[:-1], shape[-1] // block * type_size) if shape else (0,)
  start = data_start + info.offset
  nbytes = math.prod(view_shape) * dtype.itemsize
  data = file[start : start + nbytes].view(dtype).reshape(view_shape)
  return Tensor(info.name, qtype, shape, start, data)


def open_file(path: Path) -> GGUFFile:
  """The file mapped, its header parsed and its tensor table checked (see the module
  docstring).

  Raises:
    FileNotFoundError: no such file.
    CheckpointError: not a GGUF file, a header that cannot be read (cut or corrupt), a
      tensor whose bytes do not lie where its shape and type say; names the file and tensor.
  """
  size = os.path.getsize(path)  # FileNotFoundError names the file
  if size < 4:
    raise CheckpointError(f"{path}: not a GGUF file: {size} bytes, shorter than the magic")
  with open(path, "rb") as f:
    magic = f.read(4)
    if magic != b"GGUF":
      raise CheckpointError(f"{path}: not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  try:
    header = parse_header(mapping, path)
    check_tensor_infos(path, header.tensors, header.data_start, header.alignment, size)
  except BaseException:
    with contextlib.suppress(BufferError):  # none should be left: parsing copies what it reads
      mapping.close()
    raise
  file = np.frombuffer(mapping, np.uint8)
  tensors = {t.name: _tensor(t, header.data_start, file, header.byteorder) for t in header.tensors}
  return GGUFFile(path, header, mapping, tensors)


__all__ = ["GGUFFile", "Tensor", "TensorInfo", "check_tensor_infos", "open_file"]
