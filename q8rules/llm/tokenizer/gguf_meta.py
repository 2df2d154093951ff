"""Read the key-value metadata of a GGUF file without its tensors (a vocabulary file of
llama.cpp's test suite, or a model's tokenizer keys).

The header is parsed by `q8rules.checkpoint.gguf.parse` (both byte orders, GGUF v2 / v3);
values come back as `GGUFCheckpoint.metadata` gives them: str, int, float, bool, and lists
of those (an array of arrays flattened, as gguf-py's reader gives it).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint.gguf.metadata import field_value
from q8rules.checkpoint.gguf.parse import parse_header


def read_metadata(path: str | Path, prefixes: tuple[str, ...] = ("",)) -> dict[str, Any]:
  """The GGUF file's key-value fields whose keys start with one of `prefixes`.

  Raises:
    CheckpointError: not a GGUF v2/v3 file, or a header cut or corrupt; names the file and
      what was being read.
  """
  with open(path, "rb") as f:
    if os.fstat(f.fileno()).st_size == 0:
      raise CheckpointError(f"{path}: not a GGUF file (0 bytes)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      header = parse_header(data, path)
  return {
    key: field_value(field)[0] for key, field in header.fields.items() if key.startswith(prefixes)
  }
