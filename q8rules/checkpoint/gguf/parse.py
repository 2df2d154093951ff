"""Parsing a GGUF file's header: its key-value fields as Python values, its tensor table.

The layout (llama.cpp's `gguf.h`, versions 2 and 3): the magic `b'GGUF'`, a uint32
version, uint64 tensor and key-value counts; the key-value fields (a string key, a uint32
value type, the value); one entry per tensor (a string name, a uint32 `n_dims`, `n_dims`
uint64 dims in ggml order (`ne`), a uint32 ggml type id, a uint64 offset into the data
section); then the data section, where the header ends padded to `general.alignment`
(default 32). A string is a uint64 byte count then its UTF-8 bytes; an array is a uint32
item type, a uint64 count, then the items (arrays of arrays too). A file is in one byte
order throughout, told as gguf-py tells it: its version read in the host's order has its
low 16 bits zero when the file is in the other order.

`parse_header(buf, path)` reads all of it from a buffer (an `mmap` of the file) with
`struct`: one unpack per scalar, one `np.frombuffer` per array of numbers, one tight loop
per array of strings, and no numpy object per item (gguf-py's reader makes two views
per string: most of the time it took to open a file with a large vocabulary). Values are
what gguf-py's reader gives (`contents()` of its fields: int, float, bool, str, lists),
except that an array of arrays keeps its nesting (`metadata.field_value` flattens it as
gguf-py does). A header cut or corrupt anywhere raises `CheckpointError` naming the file
and what was being read, never a struct or index error.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType

from q8rules.checkpoint._common import CheckpointError

SUPPORTED_VERSIONS = (2, 3)

MAX_DEPTH = 16
"""Arrays nested deeper than this are refused, as a corrupt header."""

SCALAR_CODES: dict[GGUFValueType, str] = {
  GGUFValueType.UINT8: "B",
  GGUFValueType.INT8: "b",
  GGUFValueType.UINT16: "H",
  GGUFValueType.INT16: "h",
  GGUFValueType.UINT32: "I",
  GGUFValueType.INT32: "i",
  GGUFValueType.FLOAT32: "f",
  GGUFValueType.BOOL: "?",
  GGUFValueType.UINT64: "Q",
  GGUFValueType.INT64: "q",
  GGUFValueType.FLOAT64: "d",
}
"""The struct (and numpy) format character of each scalar GGUF value type."""

_VALUE_TYPES = {int(t): t for t in GGUFValueType}


class Field(NamedTuple):
  """One key-value field.

  value: int, float, bool or str; an array is a list of its items, an array of arrays
    a list of lists.
  types: the GGUF value types along the value, as gguf-py's reader lists them: `(type,)`
    for a scalar or string; `(ARRAY, item type)` for an array (an empty one too: its item
    type as the file says); `(ARRAY, ARRAY, ...)` for an array of arrays, following the
    first inner array.
  """

  value: Any
  types: tuple[GGUFValueType, ...]

  @property
  def type(self) -> GGUFValueType:
    """The field's GGUF value type."""
    return self.types[0]

  @property
  def sub_type(self) -> GGUFValueType | None:
    """An array's item type (ARRAY for an array of arrays); None for a scalar or string."""
    return self.types[1] if self.types[0] == GGUFValueType.ARRAY else None


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


class Header(NamedTuple):
  """A parsed GGUF header.

  version: 2 or 3; byteorder: '<' or '>', the file's; fields: key -> Field, in file order;
  tensors: the tensor table, in file order; alignment: the data alignment
  (`general.alignment`, else 32); data_start: file offset of the data section.
  """

  version: int
  byteorder: str
  fields: dict[str, Field]
  tensors: list[TensorInfo]
  alignment: int
  data_start: int


class _Cursor:
  """Reads values of one byte order from `buf`, at `pos`, raising CheckpointError on `path`."""

  def __init__(self, buf: Any, path: Any, byteorder: str):
    self.buf, self.path, self.order = buf, path, byteorder
    self.pos, self.end = 0, len(buf)
    self.u32 = struct.Struct(byteorder + "I").unpack_from
    self.u64 = struct.Struct(byteorder + "Q").unpack_from
    self.scalars = {t: struct.Struct(byteorder + c) for t, c in SCALAR_CODES.items()}

  def error(self, what: str) -> CheckpointError:
    return CheckpointError(f"{self.path}: cannot read the GGUF header: {what}")

  def cut(self, what: str, pos: int) -> CheckpointError:
    return self.error(
      f"{what} at byte {pos} runs past the end of the file ({self.end} bytes): the file is"
      " truncated or its header corrupt"
    )

  def need(self, n: int, what: str) -> None:
    if self.pos + n > self.end:
      raise self.cut(what, self.pos)

  def uint32(self, what: str) -> int:
    self.need(4, what)
    (v,) = self.u32(self.buf, self.pos)
    self.pos += 4
    return v

  def uint64(self, what: str) -> int:
    self.need(8, what)
    (v,) = self.u64(self.buf, self.pos)
    self.pos += 8
    return v

  def string(self, what: str) -> str:
    n = self.uint64(what)
    self.need(n, what)
    raw = self.buf[self.pos : self.pos + n]
    try:
      s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise self.error(f"{what} at byte {self.pos - 8} is not UTF-8 ({e.reason})") from None
    self.pos += n
    return s

  def value_type(self, what: str) -> GGUFValueType:
    raw = self.uint32(what)
    vtype = _VALUE_TYPES.get(raw)
    if vtype is None:
      raise self.error(f"{what} at byte {self.pos - 4}: unknown GGUF value type {raw}")
    return vtype

  def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Field:
    """The value of type `vtype` at `pos` (`what` names it in errors; `depth`: how many
    arrays it is inside)."""
    fmt = self.scalars.get(vtype)
    if fmt is not None:
      self.need(fmt.size, what)
      (v,) = fmt.unpack_from(self.buf, self.pos)
      self.pos += fmt.size
      return Field(v, (vtype,))
    if vtype == GGUFValueType.STRING:
      return Field(self.string(what), (vtype,))
    item = self.value_type(f"{what}: its item type")
    n = self.uint64(f"{what}: its length")
    if depth == 0:
      what = f"{what} (array of {n} {item.name})"
    code = SCALAR_CODES.get(item)
    if code is not None:
      size = self.scalars[item].size * n
      self.need(size, what)
      values = np.frombuffer(self.buf, self.order + code, n, self.pos).tolist()
      self.pos += size
      return Field(values, (vtype, item))
    if item == GGUFValueType.STRING:
      return Field(self.strings(n, what), (vtype, item))
    if depth >= MAX_DEPTH:
      raise self.error(f"{what}: arrays nested more than {MAX_DEPTH} deep")
    items = [self.value(item, f"{what}[{i}]", depth + 1) for i in range(n)]
    inner = items[0].types if items else (item,)
    return Field([f.value for f in items], (vtype, *inner))

  def strings(self, n: int, what: str) -> list[str]:
    """`n` strings from `pos`: the loop that takes most of a large vocabulary's time.

    No bounds check per item: a string cut by the end of the buffer comes back short,
    and then the next length (or the check after the loop) is past the end.
    """
    buf, pos, end, u64 = self.buf, self.pos, self.end, self.u64
    out: list[str] = []
    append = out.append
    k = 0
    try:
      for _ in range(n):
        (k,) = u64(buf, pos)
        pos += 8
        append(buf[pos : pos + k].decode())
        pos += k
    except struct.error:  # a length past the end: its own, or the last string's was
      item, at = (len(out) - 1, pos - k - 8) if pos > end else (len(out), pos)
      raise self.cut(f"{what} item {item}", at) from None
    except UnicodeDecodeError as e:  # pos: just past this string's length
      if pos + k > end:
        raise self.cut(f"{what} item {len(out)}", pos - 8) from None
      raise self.error(
        f"{what} item {len(out)} at byte {pos - 8} is not UTF-8 ({e.reason})"
      ) from None
    if pos > end:
      raise self.cut(f"{what} item {n - 1}", pos - k - 8)
    self.pos = pos
    return out


def byteorder_of(version_bytes: bytes) -> str:
  """'<' or '>': the byte order of a file whose 4 version bytes are `version_bytes`.

  As gguf-py tells it: read in the host's order, a version whose low 16 bits are zero
  is in the other order.
  """
  host = "<" if sys.byteorder == "little" else ">"
  other = ">" if host == "<" else "<"
  return other if int.from_bytes(version_bytes, sys.byteorder) & 0xFFFF == 0 else host


def parse_header(buf: Any, path: Any) -> Header:
  """The header of the GGUF file whose bytes are `buf` (bytes or an mmap: slicing gives bytes).

  Args:
    buf: the whole file, or at least its header (a cut one fails with the place named).
    path: names the file in errors.

  Raises:
    CheckpointError: not a GGUF file, an unsupported version, a header cut or corrupt
      (past the end, an unknown value type, a string not UTF-8, a duplicated key or
      tensor, a bad `general.alignment`); names the file and what was being read.
  """
  if buf[:4] != b"GGUF":
    raise CheckpointError(f"{path}: not a GGUF file: it starts with {bytes(buf[:4])!r}")
  cur = _Cursor(buf, path, "<")
  cur.pos = 4
  cur.need(4, "the version")
  order = byteorder_of(bytes(buf[4:8]))
  cur = _Cursor(buf, path, order)
  cur.pos = 4
  version = cur.uint32("the version")
  if version not in SUPPORTED_VERSIONS:
    raise cur.error(f"GGUF version {version} (versions 2 and 3 are supported)")
  n_tensors = cur.uint64("the tensor count")
  n_kv = cur.uint64("the key-value count")
  fields: dict[str, Field] = {}
  for i in range(n_kv):
    key = cur.string(f"the key of field {i} of {n_kv}")
    what = f"the value of key {key!r}"
    field = cur.value(cur.value_type(f"{what}: its type"), what)
    if key in fields:
      raise cur.error(f"key {key!r} appears twice")
    fields[key] = field
  tensors = _tensor_table(cur, n_tensors)
  alignment = _alignment(cur, fields.get("general.alignment"))
  data_start = -(-cur.pos // alignment) * alignment
  return Header(version, order, fields, tensors, alignment, data_start)


def _tensor_table(cur: _Cursor, n: int) -> list[TensorInfo]:
  """The `n` tensor-table entries at the cursor, names checked unique."""
  tensors, names = [], set()
  for i in range(n):
    name = cur.string(f"the name of tensor {i} of {n}")
    what = f"the table entry of tensor {name!r}"
    n_dims = cur.uint32(f"{what}: its n_dims")
    cur.need(8 * n_dims, f"{what}: its {n_dims} dims")
    dims = struct.unpack_from(f"{cur.order}{n_dims}Q", cur.buf, cur.pos)
    cur.pos += 8 * n_dims
    type_id = cur.uint32(f"{what}: its type")
    offset = cur.uint64(f"{what}: its offset")
    if name in names:
      raise cur.error(f"tensor {name!r} appears twice in the tensor table")
    names.add(name)
    tensors.append(TensorInfo(name, type_id, dims[::-1], offset))
  return tensors


def _alignment(cur: _Cursor, field: Field | None) -> int:
  """The data alignment `general.alignment` gives (32 without it), checked as gguf-py does."""
  if field is None:
    return GGUF_DEFAULT_ALIGNMENT
  if field.types != (GGUFValueType.UINT32,):
    raise cur.error(f"general.alignment is {field.type.name}, not UINT32")
  a = field.value
  if a == 0 or a & (a - 1):
    raise cur.error(f"general.alignment {a} is not a power of two")
  return a


__all__ = [
  "MAX_DEPTH",
  "SCALAR_CODES",
  "SUPPORTED_VERSIONS",
  "Field",
  "Header",
  "TensorInfo",
  "byteorder_of",
  "parse_header",
]
