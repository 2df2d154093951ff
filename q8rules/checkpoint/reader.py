"""`CheckpointReader`: what every checkpoint reader is, so that loading code types against one
interface instead of probing a reader for methods.

A reader is a lazy `Mapping[str, Q8Array | np.ndarray]` of a checkpoint's tensors by name,
and more: a tensor's shapes without reading it (`spec`), one region of it reading only its
bytes (`read_region`, a shard on a mesh), per-layer tensors stacked along a new leading axis
(`get_stacked`) and stacks concatenated along their last axis (`get_fused`), each in one pass
where the format allows, the release of a tensor's file pages once it is read (`release`),
the bytes read so far (`bytes_read`), and `close`.

Every reader implements all of it. The defaults here are the plain forms (read each tensor,
then stack or concatenate the arrays; release nothing); a reader overrides what its format
does faster: `GGUFCheckpoint` repacks a stack or a fused group of Q8_0 tensors straight into
one array, `GGUFSplitCheckpoint` hands each part its run of them. `ArrayReader` is the reader
of arrays already in memory (a dict), so a mapping a user passes in needs no other path.

Values: a Q8_0 tensor is a `Q8Array` (numpy `q` int8, `scale` float16 or float32); any other a
numpy array. `spec` gives the same with `jax.ShapeDtypeStruct`s in place of arrays.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from q8rules.checkpoint._common import CheckpointError, region_of, shape_dtype
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.q8_0 import Q8Array

Value = Any
"""A tensor as a reader gives it: a `Q8Array` of numpy arrays, or a numpy array."""


def _joined(arrays: Sequence[Any], axis: int | None) -> np.ndarray:
  """`arrays` stacked (axis None) or concatenated along `axis` into one new array that starts
  on a 64-byte boundary (`host_buffers`: JAX's CPU client adopts it without a copy)."""
  arrays = [np.asarray(a) for a in arrays]
  if axis is None:
    shape = (len(arrays), *arrays[0].shape)
    out = aligned_empty(shape, arrays[0].dtype)
    np.stack(arrays, out=out)
    return out
  axis %= arrays[0].ndim
  shape = list(arrays[0].shape)
  shape[axis] = sum(a.shape[axis] for a in arrays)
  out = aligned_empty(shape, arrays[0].dtype)
  np.concatenate(arrays, axis=axis, out=out)
  return out


def stack(parts: Sequence[Value]) -> Value:
  """Values of one shape stacked along a new leading axis (a Q8Array's q and scale each)."""
  if isinstance(parts[0], Q8Array):
    q = _joined([p.q for p in parts], None)
    scale = _joined([p.scale for p in parts], None)
    return Q8Array(q=q, scale=scale, axis=parts[0].axis, dtype=parts[0].dtype)
  return _joined(parts, None)


def concat(parts: Sequence[Value], axis: int = -1) -> Value:
  """Values concatenated along `axis` (a Q8Array's q and scale each; the last axis is N, the
  columns, which the scales share; axis 0 of a stack is its layers)."""
  if isinstance(parts[0], Q8Array):
    q = _joined([p.q for p in parts], axis)
    scale = _joined([p.scale for p in parts], axis)
    return Q8Array(q=q, scale=scale, axis=parts[0].axis, dtype=parts[0].dtype)
  return _joined(parts, axis)


def stack_specs(specs: Sequence[Any]) -> Any:
  """The spec of the values of `specs` stacked along a new leading axis."""

  def stacked(*leaves: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)

  return jax.tree.map(stacked, *specs)


def concat_specs(specs: Sequence[Any]) -> Any:
  """The spec of the values of `specs` concatenated along their last axis."""

  def joined(*leaves: Any) -> jax.ShapeDtypeStruct:
    n = sum(leaf.shape[-1] for leaf in leaves)
    return jax.ShapeDtypeStruct((*leaves[0].shape[:-1], n), leaves[0].dtype)

  return jax.tree.map(joined, *specs)


class CheckpointReader(Mapping[str, Value], abc.ABC):
  """A checkpoint's tensors by name, read when asked for (see the module docstring).

  Attributes:
    path: where the checkpoint is (messages name it; None: tensors in memory).
  """

  path: Any

  # ---- what each reader defines ----

  @abc.abstractmethod
  def __iter__(self) -> Iterator[str]:
    """The tensor names, in the checkpoint's order."""

  @abc.abstractmethod
  def __len__(self) -> int: ...

  @abc.abstractmethod
  def __contains__(self, name: object) -> bool:
    """Whether the checkpoint has tensor `name` (without reading it)."""

  @abc.abstractmethod
  def spec(self, name: str) -> Any:
    """Shapes and dtypes of `self[name]` without reading it: a `Q8Array` of
    `jax.ShapeDtypeStruct`s for a Q8_0 tensor, else a `jax.ShapeDtypeStruct`."""

  @abc.abstractmethod
  def get_tensor(self, name: str) -> Value:
    """Read tensor `name` (`self[name]`)."""

  @abc.abstractmethod
  def read_region(self, name: str, index: Any) -> Value:
    """`self[name][index]` (slices over the value's shape; a Q8Array's over q, its blocked
    axis on whole blocks), reading only the region's bytes where the format allows."""

  @property
  @abc.abstractmethod
  def bytes_read(self) -> int:
    """Bytes of tensor data read so far."""

  # ---- what each reader may do faster ----

  def __getitem__(self, name: str) -> Value:
    return self.get_tensor(name)

  def get_stacked(self, names: Sequence[str]) -> Value:
    """Tensors `names` (all of one shape and type) stacked along a new leading axis, in that
    order: here, each read (and released) in turn, then stacked."""
    shapes = {str(jax.tree.map(lambda a: tuple(a.shape), self.spec(n))) for n in names}
    if len(shapes) != 1:
      raise CheckpointError(
        f"{self.path}: tensors {names[0]!r} ... {names[-1]!r} cannot be stacked: they have"
        f" {len(shapes)} shapes ({', '.join(sorted(shapes))})"
      )
    parts = []
    for name in names:
      parts.append(self.get_tensor(name))
      self.release(name)
    return stack(parts)

  def get_fused(self, groups: Sequence[Sequence[str]]) -> Value:
    """The stacks of `groups` (each as `get_stacked` gives it, all of one depth)
    concatenated along their last axis (N), in that order."""
    if len({len(g) for g in groups}) != 1:
      raise CheckpointError(
        f"{self.path}: stacks of {sorted({len(g) for g in groups})} tensors cannot be fused"
        f" (every member needs one tensor per layer): {[g[0] for g in groups if g]}"
      )
    return concat([self.get_stacked(group) for group in groups])

  def release(self, name: str) -> None:
    """Drop what holds tensor `name`'s bytes in this process once it is read (a no-op here)."""
    del name

  def close(self) -> None:
    """Let go of the checkpoint (arrays already returned stay valid)."""

  def __enter__(self) -> CheckpointReader:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


class MappedReader(CheckpointReader):
  """A reader whose tensor names are the keys of its mapping `_tensors` (a file's tensor
  table, or the arrays themselves)."""

  _tensors: Mapping[str, Any]

  def __iter__(self) -> Iterator[str]:
    return iter(self._tensors)

  def __len__(self) -> int:
    return len(self._tensors)

  def __contains__(self, name: object) -> bool:
    return name in self._tensors


class ArrayReader(MappedReader):
  """The reader of tensors already in memory: a mapping of name -> `Q8Array` or array."""

  def __init__(self, tensors: Mapping[str, Value], path: Any = None):
    self._tensors = tensors
    self.path = path
    self._read = 0

  def spec(self, name: str) -> Any:
    value = self._tensors[name]
    if isinstance(value, Q8Array):
      return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), value)
    return jax.ShapeDtypeStruct(*shape_dtype(value))

  def get_tensor(self, name: str) -> Value:
    value = self._tensors[name]
    self._read += _nbytes(value)
    return value

  def read_region(self, name: str, index: Any) -> Value:
    value = region_of(self._tensors[name], index)
    self._read += _nbytes(value)
    return value

  @property
  def bytes_read(self) -> int:
    return self._read


def _nbytes(value: Value) -> int:
  return sum(int(np.size(a)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(value))


def as_reader(tensors: Mapping[str, Value]) -> CheckpointReader:
  """`tensors` itself when it is a reader, else an `ArrayReader` of it."""
  return tensors if isinstance(tensors, CheckpointReader) else ArrayReader(tensors)


__all__ = [
  "ArrayReader",
  "CheckpointReader",
  "MappedReader",
  "Value",
  "as_reader",
  "concat",
  "concat_specs",
  "stack",
  "stack_specs",
]
