"""Reading: `load(path) -> GGUFCheckpoint`, a lazy mapping of a GGUF file's tensors.

Q8_0 tensors are repacked into `Q8Array`s without dequantising: `q` and the
float16 scales are copied out of the file's 34-byte blocks as they are. The
layouts and tensor types are described in `q8rules.checkpoint.gguf`.
"""

from __future__ import annotations

import functools
import mmap as mmap_lib
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf as gguf_lib
import jax
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType, GGUFValue

from q8rules.checkpoint._common import CheckpointError, progress_iter, region_of
from q8rules.checkpoint.gguf import regions, repack, repack_sources, stream
from q8rules.checkpoint.gguf.header import GGUFFile, Tensor, open_file
from q8rules.checkpoint.gguf.layouts import (
  PLAIN_TYPES,
  Q8_0,
  Layout,
  check_layout,
  check_scale_dtype,
  q8_shapes,
  swap_last,
)
from q8rules.checkpoint.gguf.metadata import read_fields
from q8rules.checkpoint.gguf.repack_sources import Sources
from q8rules.checkpoint.gguf.requant import TypePolicy, describe_requantized
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.checkpoint.reader import MappedReader
from q8rules.q8_0 import Q8Array


class GGUFCheckpoint(MappedReader):
  """Every tensor of a GGUF file by its GGUF name, repacked lazily when asked for.

  The file is memory-mapped (once, `header.open_file`); opening reads only its
  header, and `ckpt[name]` reads and repacks that one tensor, each time it is
  asked for (nothing is cached: a file larger than memory can be walked
  tensor by tensor). `repacked` counts the tensors materialised so far.

  Values (see `q8rules.checkpoint.gguf` for layouts): a tensor served as Q8_0 (Q8_0 in the
  file; another quantized type, requantized; with `quantize='q8_0'` a float weight matrix,
  quantized: `policy.served_type`) is a `Q8Array` (`q` int8, `scale` float16 or float32,
  numpy); any other tensor a numpy array. Iteration follows the file's tensor order.

  Attributes:
    path: the file.
    layout: 'kernel' or 'gguf'.
    scale_dtype: float16 or float32, of Q8Array scales.
    dtype: the static `dtype` of the Q8Arrays (what `dequantize` gives).
    policy: what each tensor is served as (`requant.TypePolicy`: `dequantize_other`,
      `quantize`).
    requantized: how many tensors of each file type are served as Q8_0 without being Q8_0
      in the file.
    progress: default of `load_all`'s progress bar (None: auto).
    repacked: Counter of the tensor names materialised so far.
  """

  def __init__(
    self,
    path: Path,
    file: GGUFFile,
    *,
    scale_dtype: np.dtype,
    policy: TypePolicy,
    layout: Layout,
    dtype: np.dtype,
    progress: bool | None,
  ):
    self.path = path
    self.layout = layout
    self.scale_dtype = scale_dtype
    self.dtype = dtype
    self.policy = policy
    self.progress = progress
    self.repacked: Counter[str] = Counter()
    self._bytes_read = 0
    self._file: GGUFFile | None = file
    self._tensors = file.tensors
    self._byteorder = file.header.byteorder
    policy.check(path, self._tensors.values(), self._byteorder)
    self.requantized = policy.requantized(self._tensors.values())

  def describe_requantized(self) -> str:
    """One line: how many tensors of which types are requantized to Q8_0 ('' if none)."""
    return describe_requantized(self.requantized)

  # ---- metadata ----

  @functools.cached_property
  def _fields(self) -> tuple[dict[str, Any], dict[str, GGUFValue]]:
    return read_fields(self._live().header.fields)

  @property
  def metadata(self) -> dict[str, Any]:
    """The file's key-value fields as Python values (str, int, float, bool, lists).

    E.g. `{'general.architecture': 'llama', 'llama.block_count': 32, ...}`, in file
    order: the values gguf-py's reader gives (`contents()` of each field), without its
    `GGUF.*` pseudo-fields (the version and counts, which are not key-value fields).
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

  @property
  def parts(self) -> list[GGUFCheckpoint]:
    """The files this checkpoint reads: itself (a split set's `parts` lists its files)."""
    return [self]

  @property
  def byteorder(self) -> str:
    """The file's byte order: '<' (little-endian, llama.cpp's own) or '>'."""
    return self._byteorder

  # ---- tensors ----

  def _live(self) -> GGUFFile:
    if self._file is None:
      raise CheckpointError(f"{self.path}: the checkpoint is closed")
    return self._file

  def _info(self, name: str) -> Tensor:
    self._live()
    try:
      return self._tensors[name]
    except KeyError:
      raise KeyError(f"{self.path}: no tensor {name!r}") from None

  @property
  def bytes_read(self) -> int:
    """Bytes of tensor data copied out of the file so far (whole tensors by `get_tensor`,
    regions by `read_region`, stacks and fused groups by `get_stacked` / `get_fused`)."""
    return self._bytes_read

  def tensor_type(self, name: str) -> GGMLQuantizationType:
    """The tensor's GGUF type in the file, e.g. `GGMLQuantizationType.Q4_K`."""
    return self._info(name).tensor_type

  def served_type(self, name: str) -> GGMLQuantizationType:
    """What the tensor is served as: Q8_0 for a `Q8Array` (the file's Q8_0, a requantized
    or a quantized tensor), F32 for a quantized tensor dequantized, else its file type."""
    return self.policy.served_type(self._info(name))

  def _q8_data(self, t: Tensor) -> tuple[np.ndarray, str]:
    """(Q8_0 blocks, their byte order) of a tensor served as Q8_0 (`repack_sources.q8_data`)."""
    return repack_sources.q8_data(t, self._byteorder, self.path)

  def _sources(self, infos: Sequence[Tensor], layout: Layout | None = None) -> Sources:
    """What the repack of `infos` into `layout` (default: the checkpoint's) reads."""
    layout = layout or self.layout
    kw = dict(layout=layout, scale_dtype=self.scale_dtype, byteorder=self._byteorder)
    return repack_sources.sources(infos, **kw, path=self.path)

  def gguf_shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape in numpy order (ggml's `ne` reversed), as gguf-py's reader gives it."""
    return self._info(name).shape

  def raw(self, name: str) -> np.ndarray:
    """A read-only view of the tensor's bytes in the file's mapping, as gguf-py's reader
    gives it (its values for F16/F32/F64/I8..I64 in the file's byte order;
    uint8 blocks of shape (..., bytes of a row) for BF16 and quantized types). For
    inspection; nothing is copied; do not keep it past `close`."""
    return self._info(name).data

  def release(self, name: str) -> None:
    """Drop the file pages of tensor `name` from this process's memory (`madvise(DONTNEED)`
    on the mapping; the page cache keeps them). Reading the tensor again maps them back.
    Loading a file tensor by tensor and releasing each keeps peak memory near the size
    of what was loaded instead of twice it. A no-op where mmap.madvise is unavailable."""
    t = self._info(name)
    self._release_bytes(t.data_offset, t.data_offset + t.data.nbytes)

  def _release_bytes(self, start: int, end: int) -> None:
    """`release` of the whole pages inside the file's bytes [start, end)."""
    mm = self._live().mapping
    if not hasattr(mm, "madvise") or not hasattr(mmap_lib, "MADV_DONTNEED"):
      return
    page = mmap_lib.PAGESIZE
    first = -(-start // page) * page
    end = end // page * page
    if end > first:
      mm.madvise(mmap_lib.MADV_DONTNEED, first, end - first)

  def spec(self, name: str, *, layout: Layout | None = None) -> Q8Array | jax.ShapeDtypeStruct:
    """Shape and dtype of `self[name]` without reading it.

    Returns a `Q8Array` whose `q` and `scale` are `jax.ShapeDtypeStruct`s for a
    Q8_0 tensor, else a `jax.ShapeDtypeStruct`.
    """
    layout = layout or self.layout
    check_layout(layout)
    t = self._info(name)
    shape = self.gguf_shape(name)
    served = self.policy.served_type(t)
    if served == Q8_0:
      q_shape, scale_shape, axis = q8_shapes(shape, layout)
      return Q8Array(
        q=jax.ShapeDtypeStruct(q_shape, np.int8),
        scale=jax.ShapeDtypeStruct(scale_shape, self.scale_dtype),
        axis=axis,
        dtype=self.dtype,
      )
    dtype = PLAIN_TYPES.get(served, np.dtype(np.float32))
    return jax.ShapeDtypeStruct(swap_last(shape) if layout == "kernel" else shape, dtype)

  def __getitem__(self, name: str) -> Q8Array | np.ndarray:
    return self.get_tensor(name)

  def get_tensor(self, name: str, *, layout: Layout | None = None) -> Q8Array | np.ndarray:
    """Read and repack one tensor (`self[name]`), optionally in another layout."""
    layout = layout or self.layout
    check_layout(layout)
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
    self._bytes_read += int(t.data.nbytes)
    return value

  def read_region(
    self, name: str, index: Any, *, layout: Layout | None = None
  ) -> Q8Array | np.ndarray:
    """One region of `self[name]`, reading from the file only the bytes that hold it.

    Args:
      name: the tensor.
      index: slices over the value's shape in `layout` (a Q8_0 tensor: over q, e.g.
        (K, N) in 'kernel' layout; its K range on 32-row blocks; the scale rows follow),
        as `jax.make_array_from_callback` passes a shard's.
      layout: default: the checkpoint's.

    Returns:
      `self[name][index]` (a `Q8Array` whose q is `q[index]`), copied out of the file.
      A tensor requantized to Q8_0 is requantized whole, then its region cut out; one
      dequantized to float32 (`dequantize_other`) is read whole, then sliced.
    """
    layout = layout or self.layout
    check_layout(layout)
    t = self._info(name)
    shape = self.gguf_shape(name)
    try:
      if self.policy.served_type(t) == Q8_0:
        data, byteorder = self._q8_data(t)
        value, nbytes = regions.q8_region(
          data, shape, byteorder, self.scale_dtype, layout, self.dtype, index
        )
        nbytes = nbytes if t.tensor_type == Q8_0 else t.data.nbytes
      elif t.tensor_type in PLAIN_TYPES and t.tensor_type != GGMLQuantizationType.BF16:
        value, nbytes = regions.plain_region(t.data.reshape(shape), layout, index)
      elif t.tensor_type == GGMLQuantizationType.BF16:
        bits = t.data.reshape(-1).view(self._byteorder + "u2").reshape(shape)
        value, nbytes = regions.plain_region(bits, layout, index)
        value = value.astype(np.uint16).view(ml_dtypes.bfloat16)
      else:
        value, nbytes = region_of(self._repack(t, shape, layout), index), t.data.nbytes
    except CheckpointError as e:
      raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
    except Exception as e:
      raise CheckpointError(
        f"{self.path}: tensor {name!r} ({t.tensor_type.name}, shape {shape}): cannot read"
        f" the region {index}: {type(e).__name__}: {e}"
      ) from e
    self._bytes_read += int(nbytes)
    return value

  def _repack(self, t: Tensor, shape: tuple[int, ...], layout: Layout) -> Q8Array | np.ndarray:
    qtype = t.tensor_type
    if self.policy.served_type(t) == Q8_0:
      src = self._sources([t], layout)
      value = repack.repack_q8(
        src.datas[0], shape, src.byteorder, self.scale_dtype, layout, self.dtype, src.types
      )
      return src.checked([t], value, self.path)
    if qtype == GGMLQuantizationType.BF16:
      bits = t.data.reshape(-1).view(self._byteorder + "u2").astype(np.uint16)
      arr = bits.view(ml_dtypes.bfloat16).reshape(shape)
    elif qtype in PLAIN_TYPES:
      arr = t.data.reshape(shape)
    elif self.policy.dequantize_other or len(shape) < 2:
      arr = np.asarray(gguf_lib.quants.dequantize(t.data, qtype), np.float32).reshape(shape)
    else:  # refused when the file was opened; kept for safety
      raise CheckpointError(f"{self.path}: tensor {t.name!r} has unsupported type {qtype.name}")
    return _owned(arr, layout)

  def get_stacked(
    self, names: Sequence[str], *, out: Q8Array | None = None
  ) -> Q8Array | np.ndarray:
    """Tensors `names` stacked along a new leading axis. Q8_0 tensors all of one shape are
    repacked into one stacked Q8Array (q and scale with a leading axis of len(names); the
    checkpoint's layout; written into `out` where given) run by run, each run's file pages
    released once repacked (`stream`). Others are read one by one and stacked."""
    infos = [self._info(n) for n in names]
    shapes = {self.gguf_shape(n) for n in names}
    if len(shapes) != 1 or any(self.policy.served_type(t) != Q8_0 for t in infos):
      if out is not None:
        raise CheckpointError(f"{self.path}: only Q8_0 tensors of one shape stack into `out`")
      return super().get_stacked(names)
    (shape,) = shapes
    return self._read_q8(
      names,
      infos,
      f"Q8_0, shape {shape}",
      lambda: self._stack(infos, shape, out),
    )

  def _stack(self, infos: Sequence[Tensor], shape: tuple[int, ...], out: Any) -> Q8Array:
    """Run by run, each run's file pages released once repacked (`stream.stack`)."""
    return stream.stack(infos, shape, out, self._repacking())

  def _repacking(self) -> stream.Repacking:
    return stream.Repacking(
      self.layout, self.scale_dtype, self.dtype, self._sources_of, self._release_bytes, self.path
    )

  def _sources_of(self, t: Tensor) -> Sources:
    return self._sources([t])

  def _read_q8(
    self,
    names: Sequence[str],
    infos: Sequence[Tensor],
    what: str,
    read: Callable[[], Q8Array],
  ) -> Q8Array:
    """`read()` of the Q8_0 tensors `names` (their `infos`): a failure raised naming them
    (`what`: their type and shape), each counted as read once it is done."""
    try:
      value = read()
    except CheckpointError:
      raise
    except Exception as e:
      raise CheckpointError(
        f"{self.path}: tensors {names[0]!r} ... {names[-1]!r} ({what}): cannot read them:"
        f" {type(e).__name__}: {e}"
      ) from e
    for n, t in zip(names, infos, strict=True):
      self.repacked[n] += 1
      self._bytes_read += int(t.data.nbytes)
    return value

  def get_fused(
    self, groups: Sequence[Sequence[str]], *, out: Q8Array | None = None
  ) -> Q8Array | np.ndarray:
    """Stacks of Q8_0 tensors concatenated along N in one pass: `groups[j]` are member j's
    per-layer tensors (every group as long, all of one n_in and leading axes: an expert stack's
    E), repacked run by run straight into the columns of one (layers, *lead, K, sum of the
    members' N) Q8Array in the kernel layout (`get_stacked` of each, concatenated, without the
    copy; into `out` where given; each run's file pages released once repacked).
    Where that does not apply (another type or layout, mismatched shapes) the stacks are
    concatenated."""
    if self.layout != "kernel" or len({len(g) for g in groups}) != 1:
      return self._fused_fallback(groups, out)
    infos = [[self._info(n) for n in g] for g in groups]
    shapes = [{self.gguf_shape(n) for n in g} for g in groups]
    if any(len(sh) != 1 or len(next(iter(sh))) < 2 for sh in shapes):
      return self._fused_fallback(groups, out)
    rows = [next(iter(sh))[-2] for sh in shapes]
    lead_n = {(*next(iter(sh))[:-2], next(iter(sh))[-1]) for sh in shapes}
    if len(lead_n) != 1 or any(self.policy.served_type(t) != Q8_0 for g in infos for t in g):
      return self._fused_fallback(groups, out)
    *lead, n = lead_n.pop()
    return self._read_q8(
      [name for g in groups for name in g],
      [t for g in infos for t in g],
      f"Q8_0, {'' if not lead else f'{tuple(lead)} matrices of '}n_in {n}, fused along N",
      lambda: self._fuse(infos, rows, tuple(lead), n, out),
    )

  def _fuse(
    self, infos: Sequence[Sequence[Tensor]], rows: Any, lead: tuple[int, ...], n: int, out: Any
  ) -> Q8Array:
    """Run by run, each run's file pages released once repacked (`stream.fuse`)."""
    return stream.fuse(infos, rows, lead, n, out, self._repacking())

  def _fused_fallback(self, groups: Sequence[Sequence[str]], out: Q8Array | None) -> Any:
    if out is not None:
      raise CheckpointError(f"{self.path}: only Q8_0 members in the kernel layout fuse into `out`")
    return super().get_fused(groups)

  def load_all(self, *, progress: bool | None = None) -> dict[str, Q8Array | np.ndarray]:
    """Every tensor, repacked now, in file order (a tqdm bar when `progress`; None:
    this checkpoint's `progress`, and auto when that is None too)."""
    progress = self.progress if progress is None else progress
    names = progress_iter(
      self, total=len(self), desc=f"loading {self.path.name}", progress=progress
    )
    return {name: self[name] for name in names}

  def close(self) -> None:
    """Drop the file mapping (it is unmapped once no view of it is left, `raw`'s
    included). Arrays already returned stay valid: they are copies."""
    self._file = None
    self._tensors = {}
    self.__dict__.pop("_fields", None)

  def __enter__(self) -> GGUFCheckpoint:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"GGUFCheckpoint({str(self.path)!r}, {len(self)} tensors, layout={self.layout!r})"


def _owned(arr: np.ndarray, layout: Layout) -> np.ndarray:
  """A native-byte-order copy of `arr` (numpy order) in `layout`."""
  native = arr.dtype.newbyteorder("=")
  src = np.swapaxes(arr, -1, -2) if layout == "kernel" and arr.ndim >= 2 else arr
  out = aligned_empty(src.shape, native)
  np.copyto(out, src)
  return out


def load(
  path: str | os.PathLike[str],
  *,
  scale_dtype: Any = np.float16,
  dequantize_other: bool = False,
  quantize: str | None = None,
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
    dequantize_other: load tensors of other quantized types (Q4_0, Q6_K, ...) as
      float32 numpy arrays through `gguf.quants.dequantize`; by default each one of rank
      >= 2 is requantized to Q8_0 (`requant.q8_0_blocks`: dequantized as llama.cpp does,
      then quantized to Q8_0, a few rows at a time) and served as a Q8Array.
    quantize: None (default: float tensors as they are), or 'q8_0': the float weight
      matrices (F32, F16, BF16; `requant.quantizes_float`: what `llama-quantize` quantizes)
      are quantized to Q8_0 at load, bit-equal to `llama-quantize`'s Q8_0 output.
    layout: 'kernel' (default): Q8 matrices as (K=n_in, N=n_out) blocked along
      axis 0 and every tensor of rank >= 2 with its last two axes swapped;
      'gguf': numpy order as gguf-py's reader reports it. See `q8rules.checkpoint.gguf`.
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
  check_layout(layout)
  file = open_file(Path(path))
  return GGUFCheckpoint(
    Path(path),
    file,
    scale_dtype=check_scale_dtype(scale_dtype),
    policy=TypePolicy(dequantize_other, quantize),
    layout=layout,
    dtype=np.dtype(dtype),
    progress=progress,
  )
