"""`save_gguf(model, path)`: a loaded GGUF model, trained or not, written back as a GGUF file.

The file written is the source file (`GGUFModel.source`: the file `load_gguf` read, or all
parts of its split set, as one file) with the model's params in place of its tensors:

  * the source's metadata, every key-value as it is (tokenizer and chat template included),
    and every tensor, in the source's order;
  * a tensor whose param still holds what the load gave (the same Q8_0 blocks; for a type
    requantized at load, the blocks that requantization gives; the same float values) is
    the source's own bytes in its own type: a Q4_1 tensor stays Q4_1, so saving an
    unchanged model gives the source's tensor data byte for byte;
  * a changed matrix is written as Q8_0: a `Q8Array`'s blocks as they are (int8 values,
    float16 scales), a float matrix (a QAT model's) quantized by `q8rules.quantize` with
    float16 scales (llama.cpp's quantizer, bit for bit). A float matrix whose Q8_0 blocks
    are the source's is unchanged (it serves the same values);
  * a changed float tensor (a norm, a bias) in the source's float type (F32 for a quantized
    one loaded as float32).

Params are read tensor by tensor (a stacked param one layer at a time, a fused one by its
member's columns), and each changed tensor's bytes go to a temporary data file beside the
target; the header is written once every tensor's type is known, then the data, to a
temporary file renamed onto `path` at the end: a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from q8rules._qwix import is_with_aux, unbox
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint._common import progress_iter
from q8rules.checkpoint.gguf import PLAIN_TYPES, Q8_0, open_gguf
from q8rules.checkpoint.gguf.header import Tensor
from q8rules.checkpoint.gguf.layouts import block_dtype, swap_last
from q8rules.checkpoint.gguf.metadata import header_values
from q8rules.checkpoint.gguf.read import GGUFCheckpoint
from q8rules.checkpoint.gguf.requant import q8_0_blocks
from q8rules.checkpoint.gguf.split import GGUFSplitCheckpoint
from q8rules.checkpoint.gguf.write import header_written
from q8rules.llm.sources import GGUFSource, TensorSource
from q8rules.q8_0 import BLOCK, Q8Array, quantize
from q8rules.sharding.adapters import LORA_A, LORA_B

F32 = GGMLQuantizationType.F32
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class _Out:
  """How one tensor is written: its type and byte shape (rows, bytes of a row), and where its
  bytes are: the source's own (`offset` None) or at `offset` in the temporary data file."""

  name: str
  qtype: GGMLQuantizationType
  byte_shape: tuple[int, ...]
  nbytes: int
  offset: int | None = None


def has_lora(params: Any) -> bool:
  """Whether `params` (nested dicts) hold LoRA adapter leaves (`*_lora_a` / `*_lora_b`)."""
  if not isinstance(params, Mapping):
    return False
  return any(
    (isinstance(k, str) and k.endswith((LORA_A, LORA_B))) or has_lora(v) for k, v in params.items()
  )


class SavedModel(Protocol):
  """What `save_gguf` reads of a model (a `q8rules.llm.GGUFModel`)."""

  params: Any
  lora: object | None
  source: GGUFSource | None

  def merged(self) -> SavedModel:
    """The model with its LoRA adapters merged into its Q8_0 weights."""
    ...


def save_gguf(
  model: SavedModel, path: str | os.PathLike[str], *, progress: bool | None = None
) -> None:
  """Write `model` (a `GGUFModel` from `load_gguf`) as a complete GGUF file (see the module).

  Args:
    model: the model; with LoRA adapters in its params, its `merged()` model is written.
    path: the .gguf file to write (not the model's own source file).
    progress: a tqdm bar over tensors (None: when stderr is a terminal).

  Raises:
    CheckpointError naming the file, the tensor and its param: a param missing, of the wrong
      shape or dtype, or holding a non-finite value; an unwritable path; a source file
      changed since the load. Nothing is left at `path` (nor beside it) on any error.
    ValueError: a model not loaded from a GGUF file, or adapters in its params that its `lora`
      does not describe.
  """
  path = Path(path)
  if model.lora is not None:
    model = model.merged()
  elif has_lora(model.params):
    raise ValueError(
      f"{path}: the model's params hold LoRA adapters (*{LORA_A} / *{LORA_B}) that it does not"
      " know (GGUFModel.lora is None): add them with with_lora or load_gguf(lora=...)"
    )
  source = model.source
  if source is None:
    raise ValueError(f"{path}: the model was not loaded by load_gguf: no source file to rewrite")
  if path.resolve() in {Path(f).resolve() for f, _, _ in source.files}:
    raise CheckpointError(f"{path}: is the model's own source file; write to another path")
  source.check_files()
  ckpt = open_gguf(
    source.path,
    scale_dtype=np.float16,
    dequantize_other=source.dequantize_other,
    quantize=source.quantize,
    progress=False,
  )
  try:
    _save(ckpt, model.params, source, path, progress)
  finally:
    ckpt.close()


def _save(
  ckpt: GGUFCheckpoint | GGUFSplitCheckpoint,
  params: Any,
  source: GGUFSource,
  path: Path,
  progress: bool | None,
) -> None:
  parts = ckpt.parts
  if any(p.byteorder != "<" for p in parts):
    raise CheckpointError(f"{source.path}: a big-endian GGUF file; save_gguf writes little-endian")
  if [n for n in ckpt if n in source.tensors] != list(source.tensors):
    raise CheckpointError(f"{source.path}: its tensors are not those the model was loaded from")
  metadata = {k: v for k, v in parts[0].typed_metadata.items() if not k.startswith("split.")}
  arch, alignment, kvs = header_values(path, metadata, None)
  places = _Places(params, source, ckpt)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  data_tmp = path.with_name(f".{path.name}.{os.getpid()}.data.tmp")
  try:
    try:
      data_file = open(data_tmp, "wb")  # noqa: SIM115 (closed below, before it is read)
    except OSError as e:
      raise CheckpointError(f"{path}: cannot write there: {e}") from e
    with data_file:
      outs = []
      names = progress_iter(
        list(ckpt), total=len(list(ckpt)), desc=f"saving {path.name}", progress=progress
      )
      for name in names:  # a tensor the model does not read is copied as it is
        if name in source.tensors:
          outs.append(_encode(ckpt, name, places, data_file, path))
        else:
          outs.append(_source_out(ckpt, name))
        ckpt.release(name)
    _write(ckpt, outs, tmp, data_tmp, arch, alignment, kvs)
    os.replace(tmp, path)
  except BaseException:
    _remove(tmp)
    raise
  finally:
    _remove(data_tmp)


def _remove(path: Path) -> None:
  """Delete a temporary file if it is there."""
  with contextlib.suppress(OSError):
    path.unlink()


def _write(
  ckpt: Any,
  outs: list[_Out],
  tmp: Path,
  data_tmp: Path,
  arch: str,
  alignment: int | None,
  kvs: dict[str, Any],
) -> None:
  """The header (metadata, tensor infos) then each tensor's bytes (the source's, or the data
  file's), to `tmp`."""
  infos = [(o.name, o.byte_shape, np.dtype(np.uint8), o.nbytes, o.qtype) for o in outs]
  writer = header_written(tmp, arch, alignment, kvs, infos)
  try:
    changed = os.path.getsize(data_tmp) > 0
    data = np.memmap(data_tmp, np.uint8, mode="r") if changed else None
    for o in outs:
      if o.offset is None:
        writer.write_tensor_data(_raw_bytes(ckpt, o.name))
        ckpt.release(o.name)
      else:
        assert data is not None
        writer.write_tensor_data(data[o.offset : o.offset + o.nbytes].reshape(o.byte_shape))
    del data
  finally:
    writer.close()


def _raw_bytes(ckpt: Any, name: str) -> np.ndarray:
  """The tensor's bytes in the source file, uint8 (rows, bytes of a row) (a view)."""
  raw = ckpt.raw(name)
  return raw.view(np.uint8).reshape(*ckpt.gguf_shape(name)[:-1], -1)


class _Places:
  """Each file tensor's param path and layer in `params` as they are now (a model unrolled
  since the load: `layers_3/...` for layer 3 of `layers/...`), and each param's expected
  float shape (kernel layout: the stacked layer axis first, a fused param's whole width)."""

  def __init__(self, params: Any, source: GGUFSource, ckpt: Any):
    self.params = params
    self.where: dict[str, tuple[tuple[str, ...], int | None, TensorSource]] = {}
    depth: dict[tuple[str, ...], int] = {}
    width: dict[tuple[str, ...], int] = {}
    rows: dict[tuple[str, ...], tuple[int, ...]] = {}
    for name, src in source.tensors.items():
      path, layer = src.path, src.layer
      if layer is not None and path[0] not in params and f"{path[0]}_{layer}" in params:
        path, layer = (f"{path[0]}_{layer}", *path[1:]), None
      self.where[name] = (path, layer, src)
      value_shape = _kernel_shape(ckpt.gguf_shape(name))
      depth[path] = max(depth.get(path, 0), 0 if layer is None else layer + 1)
      width[path] = max(width.get(path, 0), src.columns[1] if src.columns else value_shape[-1])
      rows[path] = value_shape[:-1]
    self.shapes = {
      path: ((depth[path],) if depth[path] else ()) + (*rows[path], width[path]) for path in rows
    }

  def leaf(self, name: str, what: str) -> tuple[Any, tuple[str, ...], int | None, TensorSource]:
    """(the param of tensor `name`, unboxed; its path; its layer or None; its source)."""
    path, layer, src = self.where[name]
    node = self.params
    for key in path:
      if not isinstance(node, Mapping) or key not in node:
        raise CheckpointError(f"{what}: its param {'/'.join(path)} is not in the model's params")
      node = node[key]
    return unbox(node), path, layer, src


def _kernel_shape(gguf_shape: tuple[int, ...]) -> tuple[int, ...]:
  return swap_last(gguf_shape) if len(gguf_shape) >= 2 else tuple(gguf_shape)


def _host(x: Any, layer: int | None, columns: tuple[int, int] | None, what: str) -> np.ndarray:
  """`x[layer][..., columns]` on the host (only that part is copied off a device)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    raise CheckpointError(
      f"{what}: the param spans several processes; gather it (or save from one process)"
    )
  index: tuple[Any, ...] = () if layer is None else (layer,)
  if columns is not None:
    index += (Ellipsis, slice(*columns))
  part = x[index] if index else x
  return np.ascontiguousarray(jax.device_get(part))


def _encode(ckpt: Any, name: str, places: _Places, data_file: Any, path: Path) -> _Out:
  """Tensor `name`'s output: the source's bytes when its param holds what the load gave,
  else its new bytes appended to `data_file`."""
  gshape = ckpt.gguf_shape(name)
  qtype = ckpt.tensor_type(name)
  what = f"{path}: tensor {name!r}"
  leaf, ppath, layer, src = places.leaf(name, what)
  what = f"{path}: tensor {name!r} (param {'/'.join(ppath)}{'' if layer is None else f'[{layer}]'})"
  want = places.shapes[ppath]
  value_shape = _kernel_shape(gshape)
  served_q8 = ckpt.served_type(name) == Q8_0
  array = leaf.array if is_with_aux(leaf) else leaf
  if isinstance(array, Q8Array):
    if not src.dense or len(gshape) < 2:
      raise CheckpointError(f"{what}: a Q8_0 param where the file has a {qtype.name} vector")
    _check_q8(array, want, what)
    q = _host(array.q, layer, src.columns, what)
    scale = _scales_f16(_host(array.scale, layer, src.columns, what), what)
    blocks = _q8_bytes(q, scale)
    if served_q8 and np.array_equal(blocks, _served_blocks(ckpt, name)):
      return _source_out(ckpt, name)
    return _new(name, Q8_0, blocks, data_file)
  dtype = getattr(leaf, "dtype", None)
  if dtype is None or tuple(getattr(leaf, "shape", ())) != want:
    got = f"shape {tuple(leaf.shape)}" if hasattr(leaf, "shape") else type(leaf).__name__
    raise CheckpointError(f"{what}: the param has {got}, expected {want} (or a Q8_0 weight)")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise CheckpointError(f"{what}: the param has dtype {np.dtype(dtype)}, not a float dtype")
  value = _host(leaf, layer, src.columns, what)
  assert value.shape == value_shape, (value.shape, value_shape)
  if served_q8:
    served = _served_blocks(ckpt, name)
    if _same_bits(value.astype(np.float32), _block_values(served, gshape)):
      return _source_out(ckpt, name)
    _check_finite(value, what)
    blocks = _q8_bytes(*_quantized(value, what))
    if np.array_equal(blocks, served):
      return _source_out(ckpt, name)
    return _new(name, Q8_0, blocks, data_file)
  loaded = ckpt.get_tensor(name)
  if value.dtype == loaded.dtype and _same_bits(value, loaded):
    return _source_out(ckpt, name)
  _check_finite(value, what)
  if src.dense and len(gshape) >= 2 and gshape[-1] % BLOCK == 0:
    return _new(name, Q8_0, _q8_bytes(*_quantized(value, what)), data_file)
  out_type = qtype if qtype in FLOAT_TYPES else F32
  cast = value.astype(PLAIN_TYPES[out_type])
  _check_finite(cast, f"{what}: as {out_type.name}")
  gguf_order = np.swapaxes(cast, -1, -2) if cast.ndim >= 2 else cast
  raw = np.ascontiguousarray(gguf_order).view(np.uint8).reshape(*gshape[:-1], -1)
  return _new(name, out_type, raw, data_file)


def _check_q8(array: Q8Array, want: tuple[int, ...], what: str) -> None:
  """CheckpointError unless `array` is a Q8_0 matrix of float shape `want` (kernel layout)."""
  q_shape = tuple(array.q.shape)
  scale_shape = (*want[:-2], want[-2] // BLOCK, want[-1])
  if q_shape != want or tuple(array.scale.shape) != scale_shape:
    raise CheckpointError(
      f"{what}: the Q8_0 param has q {q_shape} and scale {tuple(array.scale.shape)},"
      f" expected {want} and {scale_shape}"
    )
  if np.dtype(array.q.dtype) != np.int8:
    raise CheckpointError(f"{what}: the Q8_0 param's q has dtype {np.dtype(array.q.dtype)}")


def _scales_f16(scale: np.ndarray, what: str) -> np.ndarray:
  """Q8_0 scales as float16 (exactly: float32 scales must be float16 values), all finite."""
  if scale.dtype not in (np.float16, np.float32):
    raise CheckpointError(f"{what}: Q8_0 scales of dtype {scale.dtype}, not float16 or float32")
  if not np.isfinite(scale).all():
    i = tuple(int(j) for j in np.argwhere(~np.isfinite(scale))[0])
    raise CheckpointError(f"{what}: a non-finite Q8_0 scale, scale[{i}] = {scale[i]!r}")
  with np.errstate(over="ignore"):
    s16 = scale.astype(np.float16)
  if scale.dtype != np.float16 and not np.array_equal(s16.astype(np.float32), scale):
    raise CheckpointError(
      f"{what}: float32 Q8_0 scales that are not float16 values (GGUF stores float16);"
      " quantize with scale_dtype=float16"
    )
  return s16


def _check_finite(value: np.ndarray, what: str) -> None:
  bad = ~np.isfinite(value)
  if bad.any():
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    raise CheckpointError(
      f"{what}: {int(bad.sum())} non-finite value(s), e.g. at {i} (in the kernel layout):"
      f" {value[i]!r}"
    )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
  """Whether two arrays of one float dtype and shape hold the same bits."""
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  view = np.dtype(f"u{a.dtype.itemsize}")
  return np.array_equal(np.ascontiguousarray(a).view(view), np.ascontiguousarray(b).view(view))


@jax.jit
def _quantize_kn(w: jax.Array) -> Q8Array:
  return quantize(w, axis=-2, scale_dtype=jnp.float16, check_finite=False)


def _quantized(value: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
  """A float (..., K, N) matrix quantized to Q8_0 (blocks along K, float16 scales):
  (q int8, scale float16), on the host; CheckpointError when a scale overflows float16."""
  a = _quantize_kn(jnp.asarray(value, jnp.float32))
  q, scale = np.asarray(a.q), np.asarray(a.scale)
  if not np.isfinite(scale).all():
    i = tuple(int(j) for j in np.argwhere(~np.isfinite(scale))[0])
    raise CheckpointError(
      f"{what}: block {i} holds a value beyond 127 times float16's largest: its Q8_0 scale"
      " would be inf"
    )
  return q, scale


def _q8_bytes(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """Q8_0 blocks (the file's layout, little-endian) of a kernel-layout Q8_0 matrix: q
  (..., K, N) int8, scale (..., K / 32, N) float16 -> uint8 (..., N, K / 32 * 34)."""
  *lead, k, n = q.shape
  blocks = np.empty((*lead, n, k // BLOCK), block_dtype("<"))
  blocks["d"] = np.swapaxes(scale, -1, -2)
  blocks["qs"] = np.swapaxes(q, -1, -2).reshape(*lead, n, k // BLOCK, BLOCK)
  return blocks.view(np.uint8).reshape(*lead, n, -1)


def _block_values(blocks: np.ndarray, gguf_shape: tuple[int, ...]) -> np.ndarray:
  """float32 `q * d` (exact) of Q8_0 blocks (uint8, the file's layout, little-endian) of a
  tensor of `gguf_shape`, in the kernel layout."""
  b = np.ascontiguousarray(blocks).reshape(-1).view(block_dtype("<"))
  b = b.reshape(*gguf_shape[:-1], gguf_shape[-1] // BLOCK)
  values = b["qs"].astype(np.float32) * b["d"].astype(np.float32)[..., None]
  return np.swapaxes(values.reshape(gguf_shape), -1, -2)


def _served_blocks(ckpt: Any, name: str) -> np.ndarray:
  """The Q8_0 blocks the load served tensor `name` as: the file's own (Q8_0), or its type
  requantized (`requant.q8_0_blocks`, as the load runs it)."""
  if ckpt.tensor_type(name) == Q8_0:
    return _raw_bytes(ckpt, name)
  t = Tensor(name, ckpt.tensor_type(name), ckpt.gguf_shape(name), 0, ckpt.raw(name))
  return q8_0_blocks(t, path=ckpt.path)


def _source_out(ckpt: Any, name: str) -> _Out:
  raw = _raw_bytes(ckpt, name)
  return _Out(name, ckpt.tensor_type(name), tuple(raw.shape), int(raw.nbytes))


def _new(name: str, qtype: GGMLQuantizationType, raw: np.ndarray, data_file: Any) -> _Out:
  """`raw` (uint8 (rows, bytes of a row)) appended to the data file, as tensor `name`."""
  offset = data_file.tell()
  raw.tofile(data_file)
  return _Out(name, qtype, tuple(raw.shape), int(raw.nbytes), offset)


__all__ = ["has_lora", "save_gguf"]
