"""GGUF metadata: the file's key-value fields read as Python values, and values typed to write.

Reading: `read_fields(header.fields)` gives every field `parse.parse_header`
parsed twice, as a plain Python value (str, int, float, bool, lists) and as a
typed `gguf.GGUFValue(value, type, sub_type)`.

Writing: `header_values(path, metadata, arch)` types plain values (see
`infer_value`) and splits off the two keys `GGUFWriter` takes apart,
`general.architecture` and `general.alignment`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValue, GGUFValueType

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf.parse import Field

NP_TYPES: dict[np.dtype, GGUFValueType] = {
  np.dtype(np.uint8): GGUFValueType.UINT8,
  np.dtype(np.int8): GGUFValueType.INT8,
  np.dtype(np.uint16): GGUFValueType.UINT16,
  np.dtype(np.int16): GGUFValueType.INT16,
  np.dtype(np.uint32): GGUFValueType.UINT32,
  np.dtype(np.int32): GGUFValueType.INT32,
  np.dtype(np.uint64): GGUFValueType.UINT64,
  np.dtype(np.int64): GGUFValueType.INT64,
  np.dtype(np.float32): GGUFValueType.FLOAT32,
  np.dtype(np.float64): GGUFValueType.FLOAT64,
  np.dtype(np.bool_): GGUFValueType.BOOL,
}
"""The GGUF value type of a numpy scalar of each dtype."""


def flat(value: list[Any]) -> list[Any]:
  """The items of an array of arrays (nested lists), flattened in order (as gguf-py's
  reader gives them)."""
  return [w for v in value for w in (flat(v) if isinstance(v, list) else [v])]


def field_value(field: Field) -> tuple[Any, GGUFValue]:
  """A parsed field as a Python value and as a typed `gguf.GGUFValue`.

  Arrays of arrays come back flattened, typed ARRAY of their innermost item type (as
  gguf-py's reader gives them: its `contents()` and `types[-1]`). An empty array is typed
  ARRAY of the item type the file gives (where gguf-py's reader has none and says ARRAY).
  """
  if field.type != GGUFValueType.ARRAY:
    return field.value, GGUFValue(field.value, field.type, None)
  value = flat(field.value) if field.sub_type == GGUFValueType.ARRAY else field.value
  return value, GGUFValue(value, GGUFValueType.ARRAY, field.types[-1])


def read_fields(fields: Mapping[str, Field]) -> tuple[dict[str, Any], dict[str, GGUFValue]]:
  """(key -> Python value, key -> GGUFValue) of a parsed header's fields, in file order."""
  plain: dict[str, Any] = {}
  typed: dict[str, GGUFValue] = {}
  for key, field in fields.items():
    plain[key], typed[key] = field_value(field)
  return plain, typed


def _plain(v: Any) -> Any:
  return v.item() if isinstance(v, np.generic) else v


def _scalar_type(key: str, v: Any, *, in_array: bool) -> GGUFValueType:
  if isinstance(v, np.generic):
    t = NP_TYPES.get(v.dtype)
    if t is None:
      raise CheckpointError(f"metadata {key!r}: numpy {v.dtype} has no GGUF type")
    return t
  if isinstance(v, bool):
    return GGUFValueType.BOOL
  if isinstance(v, int):
    if in_array:
      return GGUFValueType.INT32 if -(2**31) <= v < 2**31 else GGUFValueType.INT64
    if 0 <= v < 2**32:
      return GGUFValueType.UINT32
    if -(2**31) <= v < 0:
      return GGUFValueType.INT32
    if 0 <= v < 2**64:
      return GGUFValueType.UINT64
    if -(2**63) <= v < 2**63:
      return GGUFValueType.INT64
    raise CheckpointError(f"metadata {key!r}: integer {v} does not fit 64 bits")
  if isinstance(v, float):
    return GGUFValueType.FLOAT32
  if isinstance(v, (str, bytes)):
    return GGUFValueType.STRING
  raise CheckpointError(
    f"metadata {key!r}: cannot store {type(v).__name__} {v!r} (pass a gguf.GGUFValue)"
  )


def infer_value(key: str, value: Any) -> GGUFValue:
  """A Python metadata value as a typed GGUFValue.

  A GGUFValue is kept; bool is BOOL, int UINT32 (INT32 if negative; 64-bit
  types if it does not fit; INT32 in arrays, INT64 if any item needs it), float
  FLOAT32, str STRING, numpy scalars by their dtype, lists and 1-D arrays ARRAY
  of their items' type. CheckpointError naming `key` for anything else.
  """
  if isinstance(value, GGUFValue):
    return value
  if isinstance(value, np.ndarray) and value.ndim == 1:
    value = [v for v in value]
  if isinstance(value, (list, tuple)):
    if not value:
      raise CheckpointError(f"metadata {key!r}: GGUF cannot store an empty array")
    types = {_scalar_type(key, v, in_array=True) for v in value}
    if len(types) == 2 and types == {GGUFValueType.INT32, GGUFValueType.INT64}:
      types = {GGUFValueType.INT64}
    if len(types) != 1:
      raise CheckpointError(f"metadata {key!r}: array items of mixed types {sorted(types)}")
    sub = types.pop()
    return GGUFValue([_plain(v) for v in value], GGUFValueType.ARRAY, sub)
  return GGUFValue(_plain(value), _scalar_type(key, value, in_array=False))


def header_values(
  path: Path, metadata: Mapping[str, Any] | None, arch: str | None
) -> tuple[str, int | None, dict[str, GGUFValue]]:
  """(architecture, alignment or None, other key -> GGUFValue) to write `metadata` with.

  `arch` None takes metadata's `general.architecture`, else 'llama'; keys
  starting 'GGUF.' are skipped. CheckpointError naming `path` when `arch`
  disagrees with metadata's.
  """
  kvs: dict[str, GGUFValue] = {}
  meta_arch, alignment = None, None
  for key, value in (metadata or {}).items():
    if key.startswith("GGUF."):
      continue
    raw = value.value if isinstance(value, GGUFValue) else value
    if key == "general.architecture":
      meta_arch = str(raw)
    elif key == "general.alignment":
      alignment = int(raw)
    else:
      kvs[key] = infer_value(key, value)
  if arch is not None and meta_arch is not None and arch != meta_arch:
    raise CheckpointError(
      f"{path}: arch={arch!r} but metadata's general.architecture is {meta_arch!r}"
    )
  return arch or meta_arch or "llama", alignment, kvs
