"""Read the key-value metadata of a GGUF file, fast, without its tensors.

gguf-py's `GGUFReader` builds a numpy view per array element, which takes tens of
seconds for a vocabulary of 256k tokens and 500k merges; the tokenizer needs only
the key-value section, so this walks it with `struct` and numpy (GGUF v2 / v3,
little-endian). Values come back as `GGUFReader`'s `ReaderField.contents()` gives
them: str, int, float, bool, and lists of those.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from q8rules.checkpoint import CheckpointError

_SCALARS = {  # GGUF value type -> (struct format, numpy dtype)
  0: ("<B", "<u1"),
  1: ("<b", "<i1"),
  2: ("<H", "<u2"),
  3: ("<h", "<i2"),
  4: ("<I", "<u4"),
  5: ("<i", "<i4"),
  6: ("<f", "<f4"),
  7: ("<?", "?"),
  10: ("<Q", "<u8"),
  11: ("<q", "<i8"),
  12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


class _Cursor:
  def __init__(self, buf: Any, path: str):
    self.buf, self.pos, self.path = buf, 0, path

  def take(self, fmt: str) -> Any:
    value = struct.unpack_from(fmt, self.buf, self.pos)[0]
    self.pos += struct.calcsize(fmt)
    return value

  def string(self, key: str) -> str:
    n = self.take("<Q")
    raw = self.buf[self.pos : self.pos + n]
    if len(raw) != n:
      raise CheckpointError(f"{self.path}: metadata {key!r} runs past the end of the file")
    self.pos += n
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise CheckpointError(f"{self.path}: metadata {key!r}: a string is not UTF-8") from e

  def value(self, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
      return self.take(_SCALARS[vtype][0])
    if vtype == _STRING:
      return self.string(key)
    if vtype != _ARRAY:
      raise CheckpointError(f"{self.path}: metadata {key!r} has unknown GGUF type {vtype}")
    etype, count = self.take("<I"), self.take("<Q")
    if etype in _SCALARS:
      dtype = np.dtype(_SCALARS[etype][1])
      values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
      self.pos += dtype.itemsize * count
      return values
    item: Callable[[], Any] = (
      (lambda: self.string(key)) if etype == _STRING else (lambda: self.value(etype, key))
    )
    return [item() for _ in range(count)]


def read_metadata(path: str | Path, prefixes: tuple[str, ...] = ("",)) -> dict[str, Any]:
  """The GGUF file's key-value fields whose keys start with one of `prefixes`.

  Raises:
    CheckpointError: not a GGUF v2/v3 little-endian file, or a truncated header; names
      the file and the key.
  """
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size < 24:
      raise CheckpointError(f"{path}: not a GGUF file ({size} bytes)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      return _read(data, str(path), prefixes)


def _read(data: Any, path: str, prefixes: tuple[str, ...]) -> dict[str, Any]:
  cur = _Cursor(data, path)
  try:
    if data[:4] != b"GGUF":
      raise CheckpointError(f"{path}: not a GGUF file (magic {data[:4]!r})")
    version = cur.take("<4xI")
    if version not in (2, 3):
      raise CheckpointError(f"{path}: GGUF version {version} (little-endian v2 / v3 supported)")
    cur.take("<Q")  # tensor count
    n_kv = cur.take("<Q")
    out = {}
    for _ in range(n_kv):
      key = cur.string("<key>")
      value = cur.value(cur.take("<I"), key)
      if key.startswith(prefixes):
        out[key] = value
    return out
  except struct.error as e:
    raise CheckpointError(f"{path}: the GGUF header is truncated ({e})") from e
