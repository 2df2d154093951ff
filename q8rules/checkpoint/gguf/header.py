"""Opening a GGUF file: the magic, the header, and each tensor's place in the file checked.

`gguf.GGUFReader` parses the header and maps every tensor's bytes. On a
truncated file it fails with a bare numpy reshape error, and it accepts a
tensor whose shape overlaps the next one. `open_reader` checks what llama.cpp's
`gguf_init_from_file` checks (each tensor starts where the previous one ends,
padded to the alignment; its bytes lie inside the file; its rows are whole
blocks of its type) and names the file and the tensor.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import gguf as gguf_lib
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf.fast_fields import FastReader


class TensorInfo(NamedTuple):
  """One entry of the file's tensor table.

  name: the tensor's name; type_id: its ggml type id (int, maybe unknown);
  shape: numpy order (ggml's `ne` reversed); offset: bytes from the start of
  the data section.
  """

  name: str
  type_id: int
  shape: tuple[int, ...]
  offset: int


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


def _infos_of(reader: gguf_lib.GGUFReader) -> list[TensorInfo]:
  """The tensor table of a file the reader read, from its public `ReaderTensor`s."""
  start = int(reader.data_offset)
  return [
    TensorInfo(
      t.name,
      int(t.tensor_type),
      tuple(int(d) for d in reversed(t.shape.tolist())),
      t.data_offset - start,
    )
    for t in reader.tensors
  ]


def _table_of_unreadable(path: Path) -> tuple[list[TensorInfo], int, int] | None:
  """(tensor table, data start, alignment) of a file whose tensors `GGUFReader` could not map,
  or None when its header cannot be parsed either.

  The one use of gguf-py's private API, written against gguf 0.19.0: `GGUFReader.__init__`
  parses the header, then hands the tensor table's fields to `_build_tensors(start_offs,
  fields)`, which maps each tensor (and fails on a cut file). Here that step is replaced by
  one that keeps the fields; `ReaderField.parts` of a tensor entry is (name length, name
  bytes, n_dims, dims (ggml order), type id, data offset). Only error messages depend on it:
  should a later gguf change it, a bad file still fails, without the tensor named.
  """
  table: list[tuple[int, list[Any]]] = []

  class TableOnly(gguf_lib.GGUFReader):
    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
      table.append((int(start_offs), fields))

  try:
    reader = TableOnly(path, "r")
    ((start, fields),) = table
    infos = []
    for field in fields:
      _, name_data, _, dims, raw_type, offset = field.parts
      name = bytes(name_data).decode("utf-8", errors="replace")
      shape = tuple(int(d) for d in reversed(dims.tolist()))
      infos.append(TensorInfo(name, int(raw_type[0]), shape, int(offset[0])))
    return infos, start, int(reader.alignment)
  except Exception:
    return None


def open_reader(path: Path) -> gguf_lib.GGUFReader:
  """The file's `gguf.GGUFReader`, its tensor table checked (see the module docstring).

  Raises:
    FileNotFoundError: no such file.
    CheckpointError: not a GGUF file, a header that cannot be read, a tensor whose
      bytes do not lie where its shape and type say; names the file and tensor.
  """
  size = os.path.getsize(path)  # FileNotFoundError names the file
  if size < 4:
    raise CheckpointError(f"{path}: not a GGUF file: {size} bytes, shorter than the magic")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CheckpointError(f"{path}: not a GGUF file: it starts with {magic!r}, not b'GGUF'")
  try:
    reader = FastReader(path, "r")  # issue 21 hook: gguf.GGUFReader, faster metadata arrays
  except Exception as e:  # the reader fails in many ways on a cut or corrupt file
    table = _table_of_unreadable(path)
    if table is not None:
      infos, start, alignment = table
      check_tensor_infos(path, infos, start, alignment, size)
    raise CheckpointError(
      f"{path}: cannot read the GGUF header (truncated or corrupt file?): {type(e).__name__}: {e}"
    ) from e
  check_tensor_infos(path, _infos_of(reader), int(reader.data_offset), int(reader.alignment), size)
  return reader
