"""Q8 param trees as safetensors files, bit for bit.

Naming. A param tree of nested dicts (str keys without '.') is flattened to
one tensor per array, named by its dotted path:

  * an array leaf at `('layers_0', 'mlp', 'bias')` -> tensor `layers_0.mlp.bias`,
    its own dtype (bfloat16 included, through ml_dtypes);
  * a `Q8Array` leaf at `('layers_0', 'mlp', 'kernel')` -> two tensors,
    `layers_0.mlp.kernel.q8` (int8 `q`) and `layers_0.mlp.kernel.q8_scale`
    (float16 or float32 `scale`); its static `axis` and `dtype` go into the
    header metadata under the key `__q8rules__`, a JSON object:
    `{"version": 1, "q8": {"layers_0.mlp.kernel": {"axis": 0, "dtype": "float32"}}}`.

qwix `WithAux` and Flax boxed leaves are written without their wrapper (the
param path convention of `q8rules.tree_paths` skips `.array` and
`.value`); `load(path)` gives plain dicts, and `load(path, like=abstract_params)`
puts them back into the model's param tree, wrappers included, ready for
`apply` (`assign(like, assign.flatten(tree), lambda n: n)`, every shape checked).
Lists, tuples and other containers are refused (their structure could not be
rebuilt).

`load` returns numpy (host) arrays; a Q8Array's `dtype` comes back as a
numpy dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from q8rules.checkpoint import assign as _assign
from q8rules.checkpoint._common import (
  CheckpointError,
  blocked_axis,
  index_slices,
  is_q8,
  normalize_index,
  progress_iter,
)
from q8rules.checkpoint.reader import CheckpointReader
from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.tree_paths import WRAPPER_ATTRS

META_KEY = "__q8rules__"
"""Header metadata key of the Q8Arrays' static fields (JSON)."""

FORMAT_VERSION = 1
Q_SUFFIX = ".q8"
SCALE_SUFFIX = ".q8_scale"


def _dotted(keypath: Any, path: Path) -> str:
  """A jax key path as a dotted name; CheckpointError for what `load` could not rebuild."""
  parts = []
  for key in keypath:
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name in WRAPPER_ATTRS:
      continue
    if not isinstance(key, jax.tree_util.DictKey) or not isinstance(key.key, str):
      where = jax.tree_util.keystr(tuple(keypath))
      raise CheckpointError(
        f"{path}: leaf {where}: only nested dicts with str keys (and WithAux / boxed"
        f" leaves) can be saved; {key!r} is not a str dict key"
      )
    if not key.key or "." in key.key:
      raise CheckpointError(
        f"{path}: leaf {jax.tree_util.keystr(tuple(keypath))}: the key {key.key!r} is empty"
        " or holds '.', which names use as the separator"
      )
    parts.append(key.key)
  if not parts:
    raise CheckpointError(f"{path}: the tree is a single leaf; save a dict of them")
  return ".".join(parts)


def save(
  path: str | os.PathLike[str],
  params: Any,
  metadata: Mapping[str, str] | None = None,
  *,
  progress: bool | None = None,
) -> None:
  """Write a Q8 param tree as a safetensors file (exact: `load` gives the same bits).

  Args:
    path: the .safetensors file (written to a temporary file, then renamed).
    params: nested dicts of `Q8Array` and array leaves (numpy or jax, any dtype
      safetensors holds, bfloat16 included); see the module docstring for names.
    metadata: str -> str, stored in the header (`read_metadata` gives it back);
      the key `__q8rules__` is reserved.
    progress: a tqdm bar over leaves (None: on when more than 16 and stderr is
      a terminal).

  Raises:
    CheckpointError: a container other than dicts, a key holding '.', two
      leaves with one name, a reserved or non-str metadata entry.
  """
  path = Path(path)
  metadata = user_metadata(path, metadata, META_KEY)
  pairs = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q8)[0]
  tensors: dict[str, np.ndarray] = {}
  q8: dict[str, dict[str, Any]] = {}

  def put(name: str, array: Any) -> None:
    if name in tensors:
      raise CheckpointError(f"{path}: two leaves are both saved as tensor {name!r}")
    tensors[name] = np.asarray(array, order="C")  # (ascontiguousarray would make 0-d 1-d)

  for keypath, leaf in progress_iter(
    pairs, total=len(pairs), desc=f"saving {path.name}", progress=progress
  ):
    name = _dotted(keypath, path)
    if isinstance(leaf, Q8Array):
      put(name + Q_SUFFIX, leaf.q)
      put(name + SCALE_SUFFIX, leaf.scale)
      q8[name] = {"axis": int(leaf.axis), "dtype": jnp.dtype(leaf.dtype).name}
    else:
      put(name, leaf)
  metadata[META_KEY] = json.dumps({"version": FORMAT_VERSION, "q8": q8}, sort_keys=True)
  write_file(path, tensors, metadata)


def user_metadata(path: Path, metadata: Mapping[str, str] | None, reserved: str) -> dict[str, str]:
  """A caller's header metadata, checked: str -> str, without the key `reserved`.

  Raises:
    CheckpointError naming `path`: a non-str entry, or the reserved key.
  """
  metadata = dict(metadata or {})
  if reserved in metadata:
    raise CheckpointError(f"{path}: metadata key {reserved!r} is reserved")
  bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
  if bad:
    raise CheckpointError(f"{path}: safetensors metadata is str -> str; not: {bad}")
  return metadata


def write_file(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
  """Write a safetensors file to a temporary file beside `path`, then rename it (so `path` is
  never half written)."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    safetensors.numpy.save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def _open(path: Path) -> Any:
  try:
    return safetensors.safe_open(str(path), framework="np")
  except FileNotFoundError:
    raise
  except Exception as e:  # SafetensorError: truncated file, bad header, ...
    raise CheckpointError(
      f"{path}: not a readable safetensors file: {type(e).__name__}: {e}"
    ) from e


def _q8_fields(path: Path, metadata: Mapping[str, str]) -> dict[str, dict[str, Any]]:
  raw = metadata.get(META_KEY)
  if raw is None:
    return {}
  try:
    info = json.loads(raw)
    version, q8 = info["version"], info["q8"]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{path}: header metadata {META_KEY!r} is not valid: {e}") from e
  if version != FORMAT_VERSION:
    raise CheckpointError(f"{path}: {META_KEY} version {version}, this reads {FORMAT_VERSION}")
  return q8


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
  """The str -> str metadata given to `save` (without the `__q8rules__` entry)."""
  path = Path(path)
  with _open(path) as f:
    meta = dict(f.metadata() or {})
  meta.pop(META_KEY, None)
  return meta


def _insert(path: Path, tree: dict[str, Any], name: str, value: Any) -> None:
  keys = name.split(".")
  node = tree
  for i, key in enumerate(keys[:-1]):
    node = node.setdefault(key, {})
    if not isinstance(node, dict):
      raise CheckpointError(
        f"{path}: tensor {name!r} lies under {'.'.join(keys[: i + 1])!r}, which is a leaf"
      )
  if keys[-1] in node:
    raise CheckpointError(f"{path}: tensor {name!r} names a subtree of other tensors")
  node[keys[-1]] = value


class SafetensorsCheckpoint(CheckpointReader):
  """A safetensors file's tensors by name, read when asked for (a `CheckpointReader`): a Q8
  param's two tensors (`.q8`, `.q8_scale`) are one `Q8Array` under the param's dotted name, as
  `save` wrote it; every other tensor is a numpy array under its own name. Regions read only
  their rows (safetensors' slices), a Q8Array's scales the blocks of its rows."""

  def __init__(self, path: str | os.PathLike[str]):
    self.path = Path(path)
    self._file = _open(self.path)
    self._handle = self._file.__enter__()
    self._q8 = _q8_fields(self.path, self._handle.metadata() or {})
    present = list(self._handle.keys())
    parts = set()
    for base in self._q8:
      for suffix in (Q_SUFFIX, SCALE_SUFFIX):
        if base + suffix not in present:
          raise CheckpointError(f"{self.path}: Q8 param {base!r} has no tensor {base + suffix!r}")
        parts.add(base + suffix)
    self._names = [n for n in present if n not in parts] + list(self._q8)
    self._bytes_read = 0

  def __iter__(self) -> Iterator[str]:
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)

  def __contains__(self, name: object) -> bool:
    return name in self._q8 or (name in self._names)

  def _slice(self, name: str) -> Any:
    try:
      return self._handle.get_slice(name)
    except Exception as e:
      raise CheckpointError(f"{self.path}: tensor {name!r}: cannot read it: {e}") from e

  def _array_spec(self, name: str) -> jax.ShapeDtypeStruct:
    view = self._slice(name)
    return jax.ShapeDtypeStruct(tuple(view.get_shape()), _DTYPES[view.get_dtype()])

  def spec(self, name: str) -> Any:
    if name in self._q8:
      q, scale = self._array_spec(name + Q_SUFFIX), self._array_spec(name + SCALE_SUFFIX)
      return _q8_array(self.path, name, q, scale, self._q8[name])
    return self._array_spec(name)

  def _read(self, name: str, index: Any = None) -> np.ndarray:
    view = self._slice(name)
    shape = tuple(view.get_shape())
    if index is None or not shape:
      value = np.asarray(self._handle.get_tensor(name))
    else:
      value = np.asarray(view[index_slices(normalize_index(index, shape))])
    self._bytes_read += value.nbytes
    return value

  def get_tensor(self, name: str) -> Any:
    if name in self._q8:
      q, scale = self._read(name + Q_SUFFIX), self._read(name + SCALE_SUFFIX)
      return _q8_array(self.path, name, q, scale, self._q8[name])
    return self._read(name)

  def read_region(self, name: str, index: Any) -> Any:
    if name not in self._q8:
      return self._read(name, index)
    spec = self.spec(name)
    bounds = normalize_index(index, tuple(spec.q.shape))
    axis = blocked_axis(tuple(spec.q.shape), tuple(spec.scale.shape))
    blocks = tuple(
      (a // BLOCK, -(-b // BLOCK)) if i == axis else (a, b) for i, (a, b) in enumerate(bounds)
    )
    q = self._read(name + Q_SUFFIX, index_slices(bounds))
    scale = self._read(name + SCALE_SUFFIX, index_slices(blocks))
    return _q8_array(self.path, name, q, scale, self._q8[name])

  @property
  def bytes_read(self) -> int:
    return self._bytes_read

  def close(self) -> None:
    self._file.__exit__(None, None, None)


_DTYPES = {
  "BOOL": np.dtype(np.bool_),
  "U8": np.dtype(np.uint8),
  "I8": np.dtype(np.int8),
  "I16": np.dtype(np.int16),
  "U16": np.dtype(np.uint16),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(jnp.bfloat16),
  "I32": np.dtype(np.int32),
  "U32": np.dtype(np.uint32),
  "F32": np.dtype(np.float32),
  "F64": np.dtype(np.float64),
  "I64": np.dtype(np.int64),
  "U64": np.dtype(np.uint64),
}
"""safetensors' dtype names -> numpy dtypes."""


def load(path: str | os.PathLike[str], *, like: Any = None, progress: bool | None = None) -> Any:
  """Read a file written by `save` (or any safetensors file) as a nested dict, or, given
  `like`, as the model's param tree.

  Args:
    path: the .safetensors file.
    like: the param tree the tensors go into, e.g. `jax.eval_shape(q8_model.init, key,
      *inputs)['params']` (a tree of ShapeDtypeStructs is enough): the result has its
      structure, its `WithAux(Q8Array, Q8How)` wrappers and dtypes, so `apply` takes it.
      Every param must have its tensor and every tensor its param (see `assign.assign`).
    progress: a tqdm bar over tensors (None: on when more than 16 and stderr is
      a terminal).

  Returns:
    Without `like`: nested dicts of `Q8Array`s (numpy `q` int8 and `scale`, `axis`
    and `dtype` as saved) where the header says so, numpy arrays elsewhere. Names
    without the Q8 header entry load as arrays at their dotted path. With `like`:
    `like`'s tree with jax arrays in it.

  Raises:
    CheckpointError: not a safetensors file (truncated, bad header), a Q8
      entry without its `.q8` or `.q8_scale` tensor or with inconsistent
      shapes or dtypes, names that collide as a tree; with `like`, a param
      without a tensor, a tensor without a param, or one that does not fit.
  """
  with SafetensorsCheckpoint(path) as reader:
    if like is not None:
      try:
        return _assign.assign(like, reader, lambda n: n, progress=progress)
      except CheckpointError as e:
        raise CheckpointError(f"{reader.path}: {e}") from e
    tree: dict[str, Any] = {}
    names = progress_iter(
      list(reader), total=len(reader), desc=f"loading {reader.path.name}", progress=progress
    )
    for name in names:
      _insert(reader.path, tree, name, reader[name])
    return tree


def _q8_array(path: Path, name: str, q: np.ndarray, scale: np.ndarray, fields: Any) -> Q8Array:
  try:
    axis, dtype = int(fields["axis"]), jnp.dtype(fields["dtype"])
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: Q8 param {name!r}: bad header entry {fields!r}") from e
  problems = []
  if q.dtype != np.int8:
    problems.append(f"q dtype {q.dtype}, not int8")
  if scale.dtype not in (np.float16, np.float32):
    problems.append(f"scale dtype {scale.dtype}, not float16 or float32")
  if not -q.ndim <= axis < q.ndim:
    problems.append(f"axis {axis} for q of rank {q.ndim}")
  else:
    want = list(q.shape)
    want[axis] //= BLOCK
    if q.shape[axis] % BLOCK or tuple(scale.shape) != tuple(want):
      problems.append(f"q shape {q.shape} and scale shape {scale.shape} do not fit axis {axis}")
  if problems:
    raise CheckpointError(f"{path}: Q8 param {name!r}: " + "; ".join(problems))
  return Q8Array(q=q, scale=scale, axis=axis, dtype=dtype)


__all__ = [
  "META_KEY",
  "SafetensorsCheckpoint",
  "load",
  "read_metadata",
  "save",
  "user_metadata",
  "write_file",
]
