"""`FastReader`: gguf-py's `GGUFReader` with its metadata arrays parsed in one pass.

`GGUFReader` parses an array field element by element, each element a few `np.memmap`
slices (whose `__array_finalize__` is slow): a tokenizer of 49152 tokens (SmolLM) took 3-6 s
to open, a 128k one (Llama 3) far longer, most of `load_gguf`'s time on a small model. This
subclass reads arrays of scalars and of strings with one scan over plain ndarray views of
the same mapping and builds the same `ReaderField` (the same `parts`, `data` indices and
`types`), so `field.contents()` and everything downstream is unchanged
(tests/test_gguf_fast_fields.py compares the two readers field by field). Big-endian files
and nested arrays go through gguf-py's own code.
"""

from __future__ import annotations

from typing import Any

import gguf as gguf_lib
import numpy as np
from gguf import GGUFValueType


class FastReader(gguf_lib.GGUFReader):
  """`gguf.GGUFReader`, faster on long metadata arrays (same fields)."""

  def _get_field_parts(
    self, orig_offs: int, raw_type: int
  ) -> tuple[int, list[Any], list[int], list[Any]]:
    if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
      return super()._get_field_parts(orig_offs, raw_type)
    raw_itype = self._get(orig_offs, np.uint32)
    alen = self._get(orig_offs + 4, np.uint64)
    itype = GGUFValueType(int(raw_itype[0]))
    n = int(alen[0])
    nptype = self.gguf_scalar_to_np.get(itype)
    if itype != GGUFValueType.STRING and nptype is None:  # arrays of arrays
      return super()._get_field_parts(orig_offs, raw_type)
    plain = self.data.view(np.ndarray)  # the mapping without np.memmap's per-slice cost
    offs = orig_offs + 12
    parts: list[Any] = [raw_itype, alen]
    if nptype is not None:
      size = np.dtype(nptype).itemsize * n
      values = plain[offs : offs + size].view(nptype)
      if len(values) != n:
        raise ValueError(f"array field at {orig_offs}: {n} values run past the end of the file")
      parts += list(values.reshape(n, 1))
      return 12 + size, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY] + [itype] * bool(n)
    buf = memoryview(plain)
    end = len(plain)
    data: list[int] = []
    for _ in range(n):
      if offs + 8 > end:
        raise ValueError(f"string array at {orig_offs} runs past the end of the file")
      slen = int.from_bytes(buf[offs : offs + 8], "little")
      if offs + 8 + slen > end:
        raise ValueError(f"string array at {orig_offs} runs past the end of the file")
      parts.append(plain[offs : offs + 8].view(np.uint64))
      data.append(len(parts))
      parts.append(plain[offs + 8 : offs + 8 + slen])
      offs += 8 + slen
    types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if n else [])
    return offs - orig_offs, parts, data, types


__all__ = ["FastReader"]
