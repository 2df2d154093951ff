"""Writing: `save(path, tensors)`, a GGUF file that `gguf.GGUFReader` and llama.cpp read.

Each tensor is planned first (`_plan`: its GGUF shape and type, every check
made before a byte is written), then encoded one at a time (`_encode`: a
`Q8Array` into 34-byte Q8_0 blocks, an array as it is).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf as gguf_lib
import numpy as np
from gguf import GGMLQuantizationType

from q8rules.checkpoint._common import CheckpointError, progress_iter
from q8rules.checkpoint.gguf.layouts import (
  BLOCK_BYTES,
  DTYPE_TO_TYPE,
  GGML_MAX_DIMS,
  Q8_0,
  SCALE_DTYPES,
  Layout,
  block_dtype,
  check_layout,
  q8_shapes,
  swap_last,
)
from q8rules.checkpoint.gguf.metadata import header_values
from q8rules.checkpoint.reader import as_reader
from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.tree_paths import listing


@dataclass(frozen=True)
class _Plan:
  """How one tensor is written: what `GGUFWriter.add_tensor_info` is told."""

  name: str
  q8: bool
  shape: tuple[int, ...]  # the value's shape (our layout)
  gguf_shape: tuple[int, ...]  # numpy order in the file
  info_shape: tuple[int, ...]  # byte shape for raw types, else gguf_shape
  info_dtype: np.dtype
  raw_dtype: GGMLQuantizationType | None
  nbytes: int


def _check_rank(what: str, shape: tuple[int, ...]) -> None:
  if not 1 <= len(shape) <= GGML_MAX_DIMS:
    raise CheckpointError(f"{what}: a GGUF tensor has 1 to 4 dimensions, this has shape {shape}")


def _plan_q8(what: str, name: str, value: Q8Array, layout: Layout) -> _Plan:
  shape = tuple(int(s) for s in value.q.shape)
  _check_rank(what, shape)
  ndim = len(shape)
  axis = value.axis % ndim
  want = ndim - 2 if layout == "kernel" and ndim >= 2 else ndim - 1
  if axis != want:
    raise CheckpointError(
      f"{what}: Q8Array of shape {shape} blocked along axis {axis}; in the {layout!r} layout"
      f" a Q8_0 tensor of rank {ndim} is blocked along axis {want}"
    )
  gguf_shape = swap_last(shape) if layout == "kernel" else shape
  if gguf_shape[-1] % BLOCK:
    raise CheckpointError(f"{what}: blocked axis of {gguf_shape[-1]}, not a multiple of {BLOCK}")
  _, scale_shape, _ = q8_shapes(gguf_shape, layout)
  if tuple(value.scale.shape) != scale_shape:
    raise CheckpointError(
      f"{what}: Q8Array with q {shape} has scale {tuple(value.scale.shape)}, expected {scale_shape}"
    )
  if np.dtype(value.q.dtype) != np.int8:
    raise CheckpointError(f"{what}: Q8Array q has dtype {np.dtype(value.q.dtype)}, not int8")
  if np.dtype(value.scale.dtype) not in SCALE_DTYPES:
    raise CheckpointError(f"{what}: Q8Array scale dtype {np.dtype(value.scale.dtype)}")
  info_shape = (*gguf_shape[:-1], gguf_shape[-1] // BLOCK * BLOCK_BYTES)
  return _Plan(
    name, True, shape, gguf_shape, info_shape, np.dtype(np.uint8), Q8_0, math.prod(info_shape)
  )


def _plan(path: Path, name: str, value: Any, layout: Layout) -> _Plan:
  """How tensor `name` (a Q8Array, an array or their specs) is written; CheckpointError
  naming it when GGUF cannot hold it."""
  what = f"{path}: tensor {name!r}"
  if isinstance(value, Q8Array):
    return _plan_q8(what, name, value, layout)
  shape = tuple(int(s) for s in np.shape(value))
  dtype = getattr(value, "dtype", None)
  dtype = np.asarray(value).dtype if dtype is None else np.dtype(dtype)
  if dtype.byteorder not in "=|":
    dtype = dtype.newbyteorder("=")
  _check_rank(what, shape)
  qtype = DTYPE_TO_TYPE.get(dtype)
  if qtype is None:
    raise CheckpointError(
      f"{what}: dtype {dtype} has no GGUF tensor type (F32, F16, BF16, F64, I8, I16, I32, I64)"
    )
  gguf_shape = swap_last(shape) if layout == "kernel" else shape
  nbytes = math.prod(shape) * dtype.itemsize
  if qtype == GGMLQuantizationType.BF16:  # the writer takes BF16 as raw bytes
    info_shape = (*gguf_shape[:-1], gguf_shape[-1] * 2)
    return _Plan(name, False, shape, gguf_shape, info_shape, np.dtype(np.uint8), qtype, nbytes)
  return _Plan(name, False, shape, gguf_shape, gguf_shape, dtype, None, nbytes)


def _scales_f16(scale: np.ndarray, what: str, round_scales: bool) -> np.ndarray:
  """Scales as float16: exact, or rounded when `round_scales`; else CheckpointError."""
  if scale.dtype == np.float16:
    return scale
  with np.errstate(over="ignore", invalid="ignore"):
    s16 = scale.astype(np.float16)
  if round_scales:
    over = np.isinf(s16) & np.isfinite(scale)
    if over.any():
      i = np.unravel_index(int(np.argmax(over)), scale.shape)
      raise CheckpointError(
        f"{what}: float32 scale[{tuple(map(int, i))}] = {scale[i]!r} overflows float16"
        f" ({int(over.sum())} of {scale.size} scales do)"
      )
    return s16
  bad = s16.astype(np.float32) != scale
  if bad.any():
    i = np.unravel_index(int(np.argmax(bad)), scale.shape)
    raise CheckpointError(
      f"{what}: {int(bad.sum())} of {scale.size} float32 scales are not float16 values"
      f" (e.g. scale[{tuple(map(int, i))}] = {scale[i]!r}, nearest float16 {s16[i]!r}),"
      " and GGUF stores Q8_0 scales as float16. Quantize with scale_dtype=float16"
      " (llama.cpp's own rule, which keeps q exact), or pass round_scales=True to round"
      " them (which changes each block's w = q * d by up to 2**-11 relative)."
    )
  return s16


def _encode(plan: _Plan, value: Any, what: str, layout: Layout, round_scales: bool) -> np.ndarray:
  """The tensor's bytes as the writer takes them (uint8 blocks, or the array)."""
  swap = layout == "kernel" and len(plan.shape) >= 2
  if plan.q8:
    if not isinstance(value, Q8Array) or tuple(value.q.shape) != plan.shape:
      raise CheckpointError(f"{what}: the value read does not match its planned shape {plan.shape}")
    q = np.asarray(value.q)
    scale = _scales_f16(np.asarray(value.scale), what, round_scales)
    if swap:
      q, scale = np.swapaxes(q, -1, -2), np.swapaxes(scale, -1, -2)
    rows, nb = plan.gguf_shape[:-1], plan.gguf_shape[-1] // BLOCK
    blocks = np.empty((*rows, nb), block_dtype("<"))
    blocks["d"] = scale
    blocks["qs"] = q.reshape(*rows, nb, BLOCK)
    return blocks.view(np.uint8).reshape(plan.info_shape)
  arr = np.asarray(value)
  if tuple(arr.shape) != plan.shape:
    raise CheckpointError(f"{what}: the value read does not match its planned shape {plan.shape}")
  if swap:
    arr = np.swapaxes(arr, -1, -2)
  if arr.dtype.byteorder not in "=|":
    arr = arr.astype(arr.dtype.newbyteorder("="))
  arr = np.ascontiguousarray(arr)  # native order: the writer swaps it if need be
  if plan.raw_dtype is not None:  # BF16
    return arr.view(np.uint8).reshape(plan.info_shape)
  return arr


def header_written(
  tmp: Path,
  arch: str,
  alignment: int | None,
  kvs: Mapping[str, Any],
  infos: Sequence[tuple[str, tuple[int, ...], Any, int, GGMLQuantizationType | None]],
) -> gguf_lib.GGUFWriter:
  """A `GGUFWriter` on `tmp` with the header, the metadata `kvs` (`header_values`' GGUFValues)
  and the tensor infos (name, shape, dtype, bytes, raw GGML type) written: the caller writes
  each tensor's data in the infos' order, then closes it (closed here on an error)."""
  writer = gguf_lib.GGUFWriter(tmp, arch)
  try:
    if alignment is not None:
      writer.add_custom_alignment(alignment)
    for key, v in kvs.items():
      writer.add_key_value(key, v.value, v.type, v.sub_type)
    for name, shape, dtype, nbytes, raw_dtype in infos:
      writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw_dtype)
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
  except BaseException:
    writer.close()
    raise
  return writer


def save(
  path: str | os.PathLike[str],
  tensors: Mapping[str, Any],
  *,
  arch: str | None = None,
  metadata: Mapping[str, Any] | None = None,
  layout: Layout = "kernel",
  round_scales: bool = False,
  progress: bool | None = None,
) -> None:
  """Write tensors as a GGUF file that `gguf.GGUFReader` and llama.cpp read.

  A `Q8Array` is written as a Q8_0 tensor (34-byte blocks, float16 `d`), an
  array as F32, F16, BF16, F64, I8, I16, I32 or I64 by its dtype. Tensors are
  written one at a time in `tensors`' order (a `GGUFCheckpoint` is repacked
  tensor by tensor, never all in memory), to a temporary file renamed to
  `path` at the end: a failure leaves no partial file.

  Args:
    path: the .gguf file to write.
    tensors: GGUF name -> `Q8Array` (numpy or jax parts) or array, in
      `layout`: 'kernel' (default) takes Q8Arrays (K, N) blocked along axis 0
      (rank r >= 2: along axis r - 2) and swaps the last two axes of every
      tensor of rank >= 2 into GGUF's `[n_out, n_in]`; 'gguf' takes numpy
      order, Q8Arrays blocked along their last axis. `save` inverts `load` of
      the same layout. The Q8Arrays' static `dtype` is not stored.
    arch: `general.architecture`; None: metadata's, else 'llama'.
    metadata: key -> value. A `gguf.GGUFValue` is written with its own type
      (`GGUFCheckpoint.typed_metadata` round-trips exactly). Plain values are
      typed: bool BOOL, int UINT32 (INT32 if negative; 64-bit types if it does
      not fit; INT32 in arrays), float FLOAT32, str STRING, numpy scalars by
      their dtype, lists and 1-D arrays ARRAY of their items' type.
      `general.alignment` sets the data alignment; keys starting 'GGUF.' are
      skipped (the reader's pseudo-fields).
    layout: 'kernel' or 'gguf' (see above).
    round_scales: GGUF stores scales as float16. Float32 scales that are not
      float16 values are an error naming the tensor unless this is set: then
      they are rounded to nearest, which changes each block's `w = q * d` by up
      to 2**-11 relative (q is kept). Quantizing with `scale_dtype=float16`
      (llama.cpp's rule) makes the question moot.
    progress: a tqdm bar over tensors (None: on when more than 16 and stderr is
      a terminal).

  Raises:
    CheckpointError: a tensor GGUF cannot hold (rank, dtype, layout), float32
      scales not float16 values, bad metadata; names the file and tensor.
  """
  check_layout(layout)
  path = Path(path)
  plans, errors = [], []
  reader = as_reader(tensors)
  for name in reader:
    try:
      plans.append(_plan(path, name, reader.spec(name), layout))
    except CheckpointError as e:
      errors.append(str(e))
  if errors:
    raise CheckpointError(f"{path}: cannot write {len(errors)} tensor(s):\n{listing(errors)}")
  arch, alignment, kvs = header_values(path, metadata, arch)

  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  infos = [(p.name, p.info_shape, p.info_dtype, p.nbytes, p.raw_dtype) for p in plans]
  writer = header_written(tmp, arch, alignment, kvs, infos)
  try:
    for p in progress_iter(plans, total=len(plans), desc=f"writing {path.name}", progress=progress):
      what = f"{path}: tensor {p.name!r}"
      writer.write_tensor_data(_encode(p, tensors[p.name], what, layout, round_scales))
    writer.close()
    os.replace(tmp, path)
  except BaseException:
    writer.close()
    tmp.unlink(missing_ok=True)
    raise
