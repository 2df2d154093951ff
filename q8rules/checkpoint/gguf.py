"""GGUF checkpoints (llama.cpp's files): Q8_0 tensors repacked into `Q8Array`s, and back.

Reading and writing go through llama.cpp's own Python package, `gguf`
(`gguf.GGUFReader`, `gguf.GGUFWriter`); this module only moves Q8_0 blocks
between the file's layout and ours, without dequantising them.

A Q8_0 tensor in a GGUF file is a run of 34-byte blocks: a float16 scale `d`
(little-endian) then 32 int8 values `qs`, with `w = qs * d`. The blocks run
along ggml's innermost axis `ne[0]`. `GGUFReader` reports shapes in numpy
order (ggml's `ne` reversed), so a weight matrix is `[n_out, n_in]` and it is
blocked along its last numpy axis, `n_in` (the contraction axis).

Layouts (`layout=` of `load` and `save`):

  * `'kernel'` (default): the layout of a Flax `Dense` kernel and of the Q8
    params that `q8rules.Q8Provider` makes. The last two numpy axes of every
    tensor of rank >= 2 are swapped, Q8_0 or not:
      - a Q8_0 matrix `[n_out, n_in]` becomes `Q8Array(q=(n_in, n_out) int8,
        scale=(n_in // 32, n_out), axis=0)`: `q = qs.reshape(n_out, n_in).T`,
        `scale = d.reshape(n_out, n_in // 32).T`;
      - a stacked tensor `[*lead, n_out, n_in]` (e.g. experts `[E, n_out, n_in]`)
        becomes `q` of shape `(*lead, n_in, n_out)`, `scale` of shape
        `(*lead, n_in // 32, n_out)`, `axis = ndim - 2`: one (K, N) matrix per
        leading index, blocked along K as in the 2-D case;
      - a Q8_0 vector `[n]` stays `(n,)` with `axis=0`;
      - a float matrix `[n_out, n_in]` comes back as `(n_in, n_out)` too, so a
        square weight can never be loaded the wrong way round. Embedding tables
        (`token_embd.weight`, `[n_vocab, n_embd]`) therefore come back as
        `(n_embd, n_vocab)`: transpose them for an `nn.Embed`, or load them with
        `ckpt.get_tensor(name, layout='gguf')`.
  * `'gguf'`: numpy order as `GGUFReader` reports it; a Q8_0 tensor
    `[..., n_in]` is a `Q8Array` blocked along its last axis (`axis = ndim - 1`).

Scales keep their float16 values exactly: float16 by default, or widened
(exactly) to float32 with `scale_dtype=np.float32`.

Tensor types: Q8_0 becomes a `Q8Array`; F32, F16, F64, I8, I16, I32 and I64
become numpy arrays of that dtype; BF16 becomes an `ml_dtypes.bfloat16` numpy
array (the same dtype as `jnp.bfloat16`, values exact). Other quantized types
are refused with an error naming each tensor and its type, unless
`dequantize_other=True`, when `gguf.quants.dequantize` turns them into float32.

Every array returned is a numpy array on the host, owned (not a view of the
file). Put it on a device with `jax.device_put`, or let `assign` place it like
the param it replaces.
"""

from __future__ import annotations

import functools
import math
import mmap as mmap_lib
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf as gguf_lib
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValue, GGUFValueType

from q8rules.checkpoint._common import CheckpointError, progress_iter, spec_of
from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.tree_paths import listing

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

_SCALE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


def _block_dtype(byteorder: str) -> np.dtype:
  """A Q8_0 block as a packed numpy record: `d` float16 then `qs` 32 int8 (34 bytes)."""
  return np.dtype([("d", byteorder + "f2"), ("qs", "i1", (BLOCK,))])


def _check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_scale_dtype(scale_dtype: Any) -> np.dtype:
  scale_dtype = np.dtype(scale_dtype)
  if scale_dtype not in _SCALE_DTYPES:
    raise ValueError(f"scale_dtype must be float16 or float32, got {scale_dtype}")
  return scale_dtype


def _swap_last(shape: tuple[int, ...]) -> tuple[int, ...]:
  return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape


def _dequantizable(qtype: GGMLQuantizationType) -> bool:
  """Whether `gguf.quants.dequantize` knows `qtype` (True when that cannot be told)."""
  traits = getattr(gguf_lib.quants, "_type_traits", None)
  return traits is None or qtype in traits


# ---- reading ------------------------------------------------------------------


class _Reader(gguf_lib.GGUFReader):
  """`gguf.GGUFReader`, checking each tensor's place in the file before it maps it.

  The reader itself would fail on a truncated file with a bare numpy reshape
  error and accept a tensor whose shape overlaps the next one; this checks
  what llama.cpp's `gguf_init_from_file` checks (each tensor starts where the
  previous one ends, padded to the alignment; the data lies inside the file)
  and names the tensor.
  """

  def __init__(self, path: Path):
    self._path = path
    super().__init__(path, "r")

  def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
    _check_tensor_infos(self._path, fields, int(start_offs), int(self.alignment), len(self.data))
    super()._build_tensors(start_offs, fields)


def _check_tensor_infos(
  path: Path, fields: list[Any], start: int, alignment: int, file_size: int
) -> None:
  """Raise CheckpointError naming the first tensor whose bytes do not fit its shape and type."""
  expected = 0
  prev: tuple[str, str, tuple[int, ...], int] | None = None
  for field in fields:
    _, name_data, _, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", errors="replace")
    shape = tuple(int(d) for d in reversed(dims.tolist()))
    try:
      qtype = GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
      raise CheckpointError(
        f"{path}: tensor {name!r} has unknown ggml type id {int(raw_type[0])}"
      ) from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    what = f"tensor {name!r} ({qtype.name}, shape {shape})"
    if shape and shape[-1] % block:
      raise CheckpointError(
        f"{path}: {what}: rows of {shape[-1]} values are not a whole number of"
        f" {qtype.name} blocks of {block}"
      )
    nbytes = math.prod(shape) // block * type_size
    off = int(offset[0])
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


def _open(path: Path) -> _Reader:
  """The file's reader; CheckpointError naming the file when it is not a readable GGUF file."""
  size = os.path.getsize(path)  # FileNotFoundError names the file
  if size < 4:
    raise CheckpointError(f"{path}: not a GGUF file: {size} bytes, shorter than the magic")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CheckpointError(f"{path}: not a GGUF file: it starts with {magic!r}, not b'GGUF'")
  try:
    return _Reader(path)
  except CheckpointError:
    raise
  except Exception as e:  # the reader fails in many ways on a cut or corrupt header
    raise CheckpointError(
      f"{path}: cannot read the GGUF header (truncated or corrupt file?): {type(e).__name__}: {e}"
    ) from e


def _field_value(field: Any) -> tuple[Any, GGUFValue]:
  """A reader field as a Python value and as a typed `gguf.GGUFValue`.

  Arrays of arrays come back flattened (as `ReaderField.contents` does).
  """
  value = field.contents()
  vtype = GGUFValueType(field.types[0])
  sub_type = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
  return value, GGUFValue(value, vtype, sub_type)


class GGUFCheckpoint(Mapping[str, "Q8Array | np.ndarray"]):
  """Every tensor of a GGUF file by its GGUF name, repacked lazily when asked for.

  The file is memory-mapped (by `gguf.GGUFReader`); opening reads only its
  header, and `ckpt[name]` reads and repacks that one tensor, each time it is
  asked for (nothing is cached: a file larger than memory can be walked
  tensor by tensor). `repacked` counts the tensors materialised so far.

  Values (see the module docstring for layouts): a Q8_0 tensor is a
  `Q8Array` (`q` int8, `scale` float16 or float32, numpy); any other tensor
  a numpy array. Iteration follows the file's tensor order.

  Attributes:
    path: the file.
    layout: 'kernel' or 'gguf'.
    scale_dtype: float16 or float32, of Q8Array scales.
    dtype: the static `dtype` of the Q8Arrays (what `dequantize` gives).
    dequantize_other: whether other quantized types come back as float32.
    progress: default of `load_all`'s progress bar (None: auto).
    repacked: Counter of the tensor names materialised so far.
  """

  def __init__(
    self,
    path: Path,
    reader: _Reader,
    *,
    scale_dtype: np.dtype,
    dequantize_other: bool,
    layout: Layout,
    dtype: np.dtype,
    progress: bool | None,
  ):
    self.path = path
    self.layout = layout
    self.scale_dtype = scale_dtype
    self.dtype = dtype
    self.dequantize_other = dequantize_other
    self.progress = progress
    self.repacked: Counter[str] = Counter()
    self._reader: _Reader | None = reader
    self._tensors = {t.name: t for t in reader.tensors}
    self._byteorder = ">" if reader.endianess == gguf_lib.GGUFEndian.BIG else "<"
    self._check_types()

  def _check_types(self) -> None:
    bad = []
    for name, t in self._tensors.items():
      qtype = t.tensor_type
      if qtype == Q8_0 or qtype in PLAIN_TYPES:
        continue
      if not self.dequantize_other:
        bad.append(f"{name!r}: {qtype.name}")
      elif not _dequantizable(qtype):
        bad.append(f"{name!r}: {qtype.name} (gguf.quants cannot dequantize it)")
    if bad:
      hint = "" if self.dequantize_other else " (dequantize_other=True loads them as float32)"
      raise CheckpointError(
        f"{self.path}: {len(bad)} tensor(s) of types other than Q8_0, F32, F16, BF16,"
        f" F64 and I8..I64{hint}:\n{listing(bad)}"
      )

  # ---- metadata ----

  @functools.cached_property
  def _fields(self) -> tuple[dict[str, Any], dict[str, GGUFValue]]:
    plain: dict[str, Any] = {}
    typed: dict[str, GGUFValue] = {}
    for key, field in self._live().fields.items():
      if key.startswith("GGUF."):  # the reader's version / count pseudo-fields
        continue
      plain[key], typed[key] = _field_value(field)
    return plain, typed

  @property
  def metadata(self) -> dict[str, Any]:
    """The file's key-value fields as Python values (str, int, float, bool, lists).

    E.g. `{'general.architecture': 'llama', 'llama.block_count': 32, ...}`;
    the reader's `GGUF.*` pseudo-fields (version, counts) are left out.
    """
    return dict(self._fields[0])

  @property
  def typed_metadata(self) -> dict[str, GGUFValue]:
    """The fields as `gguf.GGUFValue(value, type, sub_type)`: what `save` needs to write
    them back with the same GGUF types (`save(..., metadata=ckpt.typed_metadata)`)."""
    return dict(self._fields[1])

  @property
  def arch(self) -> str | None:
    """`general.architecture`, e.g. 'llama' (None if the file has none)."""
    return self._fields[0].get("general.architecture")

  # ---- tensors ----

  def _live(self) -> _Reader:
    if self._reader is None:
      raise CheckpointError(f"{self.path}: the checkpoint is closed")
    return self._reader

  def _info(self, name: str) -> Any:
    self._live()
    try:
      return self._tensors[name]
    except KeyError:
      raise KeyError(f"{self.path}: no tensor {name!r}") from None

  def __iter__(self) -> Iterator[str]:
    return iter(self._tensors)

  def __len__(self) -> int:
    return len(self._tensors)

  def __contains__(self, name: object) -> bool:
    return name in self._tensors

  def tensor_type(self, name: str) -> GGMLQuantizationType:
    """The tensor's GGUF type, e.g. `GGMLQuantizationType.Q8_0`."""
    return self._info(name).tensor_type

  def gguf_shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape in numpy order as GGUFReader gives it (ggml's `ne` reversed)."""
    return tuple(int(d) for d in reversed(self._info(name).shape.tolist()))

  def raw(self, name: str) -> np.ndarray:
    """The reader's view of the tensor's bytes in the file (uint8 blocks for quantized
    types), valid while the checkpoint is open. For inspection; nothing is copied."""
    return self._info(name).data

  def release(self, name: str) -> None:
    """Drop the file pages of tensor `name` from this process's memory (`madvise(DONTNEED)`
    on the mapping; the page cache keeps them). Reading the tensor again maps them back.
    Loading a file tensor by tensor and releasing each keeps peak memory near the size
    of what was loaded instead of twice it. A no-op where mmap.madvise is unavailable."""
    data = self._live().data
    mm = getattr(data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap_lib, "MADV_DONTNEED"):
      return
    raw = self._info(name).data
    start = raw.ctypes.data - data.ctypes.data + int(data.offset) % mmap_lib.ALLOCATIONGRANULARITY
    page = mmap_lib.PAGESIZE
    first = -(-start // page) * page  # whole pages inside the tensor only
    end = (start + raw.nbytes) // page * page
    if end > first:
      mm.madvise(mmap_lib.MADV_DONTNEED, first, end - first)

  def spec(self, name: str, *, layout: Layout | None = None) -> Q8Array | jax.ShapeDtypeStruct:
    """Shape and dtype of `self[name]` without reading it.

    Returns a `Q8Array` whose `q` and `scale` are `jax.ShapeDtypeStruct`s for a
    Q8_0 tensor, else a `jax.ShapeDtypeStruct`.
    """
    layout = layout or self.layout
    _check_layout(layout)
    t = self._info(name)
    shape = self.gguf_shape(name)
    if t.tensor_type == Q8_0:
      q_shape, scale_shape, axis = _q8_shapes(shape, layout)
      return Q8Array(
        q=jax.ShapeDtypeStruct(q_shape, np.int8),
        scale=jax.ShapeDtypeStruct(scale_shape, self.scale_dtype),
        axis=axis,
        dtype=self.dtype,
      )
    dtype = PLAIN_TYPES.get(t.tensor_type, np.dtype(np.float32))
    return jax.ShapeDtypeStruct(_swap_last(shape) if layout == "kernel" else shape, dtype)

  def __getitem__(self, name: str) -> Q8Array | np.ndarray:
    return self.get_tensor(name)

  def get_tensor(self, name: str, *, layout: Layout | None = None) -> Q8Array | np.ndarray:
    """Read and repack one tensor (`self[name]`), optionally in another layout."""
    layout = layout or self.layout
    _check_layout(layout)
    t = self._info(name)
    shape = self.gguf_shape(name)
    try:
      value = self._repack(t, shape, layout)
    except CheckpointError:
      raise
    except Exception as e:
      raise CheckpointError(
        f"{self.path}: tensor {name!r} ({t.tensor_type.name}, shape {shape}): cannot read it:"
        f" {type(e).__name__}: {e}"
      ) from e
    self.repacked[name] += 1
    return value

  def _repack(self, t: Any, shape: tuple[int, ...], layout: Layout) -> Q8Array | np.ndarray:
    qtype = t.tensor_type
    if qtype == Q8_0:
      return _repack_q8(t.data, shape, self._byteorder, self.scale_dtype, layout, self.dtype)
    if qtype == GGMLQuantizationType.BF16:
      bits = t.data.reshape(-1).view(self._byteorder + "u2").astype(np.uint16)
      arr = bits.view(ml_dtypes.bfloat16).reshape(shape)
    elif qtype in PLAIN_TYPES:
      arr = t.data.reshape(shape)
    elif self.dequantize_other:
      arr = np.asarray(gguf_lib.quants.dequantize(t.data, qtype), np.float32).reshape(shape)
    else:  # refused when the file was opened; kept for safety
      raise CheckpointError(f"{self.path}: tensor {t.name!r} has unsupported type {qtype.name}")
    return _owned(arr, layout)

  def load_all(self, *, progress: bool | None = None) -> dict[str, Q8Array | np.ndarray]:
    """Every tensor, repacked now, in file order (a tqdm bar when `progress`; None:
    this checkpoint's `progress`, and auto when that is None too)."""
    progress = self.progress if progress is None else progress
    names = progress_iter(
      self, total=len(self), desc=f"loading {self.path.name}", progress=progress
    )
    return {name: self[name] for name in names}

  def close(self) -> None:
    """Drop the file mapping (it is unmapped once no reader view is left). Arrays already
    returned stay valid: they are copies."""
    self._reader = None
    self._tensors = {}
    self.__dict__.pop("_fields", None)

  def __enter__(self) -> GGUFCheckpoint:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"GGUFCheckpoint({str(self.path)!r}, {len(self)} tensors, layout={self.layout!r})"


def _q8_shapes(
  shape: tuple[int, ...], layout: Layout
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
  """(q shape, scale shape, axis) of a Q8_0 tensor of numpy shape `shape` in `layout`."""
  scale_rows = (*shape[:-1], shape[-1] // BLOCK)
  if layout == "kernel" and len(shape) >= 2:
    return _swap_last(shape), _swap_last(scale_rows), len(shape) - 2
  return shape, scale_rows, len(shape) - 1


@jax.jit
def _transpose_last_two(a: jax.Array) -> jax.Array:
  """(..., R, C) -> (..., C, R) on the default device."""
  return jnp.swapaxes(a, -1, -2)


def _repack_q8(
  data: np.ndarray,
  shape: tuple[int, ...],
  byteorder: str,
  scale_dtype: np.dtype,
  layout: Layout,
  dtype: np.dtype,
) -> Q8Array:
  """34-byte blocks (the file's bytes) into a Q8Array, one copy each of q and d.

  data: uint8, the tensor's bytes; shape: numpy order `[*lead, n_out, n_in]`.
  """
  rows, n_in = shape[:-1], shape[-1]
  nb = n_in // BLOCK
  blocks = data.reshape(-1).view(_block_dtype(byteorder))
  qs = blocks["qs"].reshape(*rows, nb, BLOCK)  # views of the mapping
  d = blocks["d"].reshape(*rows, nb)
  q_shape, scale_shape, axis = _q8_shapes(shape, layout)
  if layout == "kernel" and len(shape) >= 2:
    lead, n_out = rows[:-1], rows[-1]
    # Gather the values row by row (32-byte runs), then transpose in XLA's tiled kernel:
    # numpy's element-wise transposing copy of int8 runs at a fraction of memory speed.
    rows_k = np.empty((*lead, n_out, nb * BLOCK), np.int8)
    np.copyto(rows_k.reshape(*lead, n_out, nb, BLOCK), qs)
    q = np.asarray(_transpose_last_two(rows_k))
    del rows_k
    scale = np.empty(scale_shape, scale_dtype)
    np.copyto(scale, np.swapaxes(d, -1, -2))
  else:
    q = np.empty((*rows, nb, BLOCK), np.int8)
    np.copyto(q, qs)
    scale = np.empty(scale_shape, scale_dtype)
    np.copyto(scale, d)
  return Q8Array(q=q.reshape(q_shape), scale=scale, axis=axis, dtype=dtype)


def _owned(arr: np.ndarray, layout: Layout) -> np.ndarray:
  """A native-byte-order copy of `arr` (numpy order) in `layout`."""
  native = arr.dtype.newbyteorder("=")
  src = np.swapaxes(arr, -1, -2) if layout == "kernel" and arr.ndim >= 2 else arr
  out = np.empty(src.shape, native)
  np.copyto(out, src)
  return out


def load(
  path: str | os.PathLike[str],
  *,
  scale_dtype: Any = np.float16,
  dequantize_other: bool = False,
  layout: Layout = "kernel",
  dtype: Any = np.float32,
  progress: bool | None = None,
) -> GGUFCheckpoint:
  """Open a GGUF file as a lazy `Mapping[str, Q8Array | np.ndarray]` of its tensors.

  Only the header is read now; it is checked (magic, each tensor's bytes lie
  where its shape and type say, inside the file; every type supported), so a
  bad file fails here, with the file and tensor named. Each tensor is read
  and repacked when asked for.

  Args:
    path: the .gguf file.
    scale_dtype: float16 (GGUF's own, default) or float32 (the same values,
      widened exactly) for Q8Array scales.
    dequantize_other: load tensors of other quantized types (Q4_0, Q6_K, ...)
      as float32 numpy arrays through `gguf.quants.dequantize`; by default they
      are refused, each named with its type.
    layout: 'kernel' (default): Q8 matrices as (K=n_in, N=n_out) blocked along
      axis 0 and every tensor of rank >= 2 with its last two axes swapped;
      'gguf': numpy order as GGUFReader reports it. See the module docstring.
    dtype: the static `dtype` of the Q8Arrays (what `q8rules.dequantize` gives;
      GGUF does not record it).
    progress: default of `load_all`'s tqdm bar (None: on when more than 16
      tensors and stderr is a terminal).

  Returns:
    A `GGUFCheckpoint`; `.metadata` / `.typed_metadata` / `.arch` hold the
    key-value fields. Values are numpy (host) arrays.

  Raises:
    CheckpointError: not a GGUF file, a truncated or corrupt file, a tensor
      whose byte count does not match its shape, an unsupported tensor type.
    FileNotFoundError: no such file.
  """
  _check_layout(layout)
  reader = _open(Path(path))
  return GGUFCheckpoint(
    Path(path),
    reader,
    scale_dtype=_check_scale_dtype(scale_dtype),
    dequantize_other=dequantize_other,
    layout=layout,
    dtype=np.dtype(dtype),
    progress=progress,
  )


# ---- writing ------------------------------------------------------------------


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


def _plan(path: Path, name: str, value: Any, layout: Layout) -> _Plan:
  what = f"{path}: tensor {name!r}"
  if isinstance(value, Q8Array):
    shape = tuple(int(s) for s in value.q.shape)
    ndim = len(shape)
    if not 1 <= ndim <= GGML_MAX_DIMS:
      raise CheckpointError(f"{what}: a GGUF tensor has 1 to 4 dimensions, this has shape {shape}")
    axis = value.axis % ndim
    want = ndim - 2 if layout == "kernel" and ndim >= 2 else ndim - 1
    if axis != want:
      raise CheckpointError(
        f"{what}: Q8Array of shape {shape} blocked along axis {axis}; in the {layout!r} layout"
        f" a Q8_0 tensor of rank {ndim} is blocked along axis {want}"
      )
    gguf_shape = _swap_last(shape) if layout == "kernel" else shape
    if gguf_shape[-1] % BLOCK:
      raise CheckpointError(f"{what}: blocked axis of {gguf_shape[-1]}, not a multiple of {BLOCK}")
    _, scale_shape, _ = _q8_shapes(gguf_shape, layout)
    if tuple(value.scale.shape) != scale_shape:
      raise CheckpointError(
        f"{what}: Q8Array with q {shape} has scale {tuple(value.scale.shape)}, expected {scale_shape}"
      )
    if np.dtype(value.q.dtype) != np.int8:
      raise CheckpointError(f"{what}: Q8Array q has dtype {np.dtype(value.q.dtype)}, not int8")
    if np.dtype(value.scale.dtype) not in _SCALE_DTYPES:
      raise CheckpointError(f"{what}: Q8Array scale dtype {np.dtype(value.scale.dtype)}")
    info_shape = (*gguf_shape[:-1], gguf_shape[-1] // BLOCK * BLOCK_BYTES)
    return _Plan(
      name, True, shape, gguf_shape, info_shape, np.dtype(np.uint8), Q8_0, math.prod(info_shape)
    )
  shape = tuple(int(s) for s in np.shape(value))
  dtype = getattr(value, "dtype", None)
  dtype = np.asarray(value).dtype if dtype is None else np.dtype(dtype)
  if dtype.byteorder not in "=|":
    dtype = dtype.newbyteorder("=")
  if not 1 <= len(shape) <= GGML_MAX_DIMS:
    raise CheckpointError(f"{what}: a GGUF tensor has 1 to 4 dimensions, this has shape {shape}")
  qtype = DTYPE_TO_TYPE.get(dtype)
  if qtype is None:
    raise CheckpointError(
      f"{what}: dtype {dtype} has no GGUF tensor type (F32, F16, BF16, F64, I8, I16, I32, I64)"
    )
  gguf_shape = _swap_last(shape) if layout == "kernel" else shape
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
    blocks = np.empty((*rows, nb), _block_dtype("<"))
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


def _infer_value(key: str, value: Any) -> GGUFValue:
  """A Python metadata value as a typed GGUFValue (see `save`)."""
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


_NP_TYPES = {
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


def _plain(v: Any) -> Any:
  return v.item() if isinstance(v, np.generic) else v


def _scalar_type(key: str, v: Any, *, in_array: bool) -> GGUFValueType:
  if isinstance(v, np.generic):
    t = _NP_TYPES.get(v.dtype)
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
  _check_layout(layout)
  path = Path(path)
  plans, errors = [], []
  for name in tensors:
    try:
      plans.append(_plan(path, name, spec_of(tensors, name)[0], layout))
    except CheckpointError as e:
      errors.append(str(e))
  if errors:
    raise CheckpointError(f"{path}: cannot write {len(errors)} tensor(s):\n{listing(errors)}")

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
      kvs[key] = _infer_value(key, value)
  if arch is not None and meta_arch is not None and arch != meta_arch:
    raise CheckpointError(
      f"{path}: arch={arch!r} but metadata's general.architecture is {meta_arch!r}"
    )
  arch = arch or meta_arch or "llama"

  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  writer = gguf_lib.GGUFWriter(tmp, arch)
  try:
    if alignment is not None:
      writer.add_custom_alignment(alignment)
    for key, v in kvs.items():
      writer.add_key_value(key, v.value, v.type, v.sub_type)
    for p in plans:
      writer.add_tensor_info(p.name, p.info_shape, p.info_dtype, p.nbytes, raw_dtype=p.raw_dtype)
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for p in progress_iter(plans, total=len(plans), desc=f"writing {path.name}", progress=progress):
      what = f"{path}: tensor {p.name!r}"
      writer.write_tensor_data(_encode(p, tensors[p.name], what, layout, round_scales))
    writer.close()
    os.replace(tmp, path)
  except BaseException:
    writer.close()
    tmp.unlink(missing_ok=True)
    raise
