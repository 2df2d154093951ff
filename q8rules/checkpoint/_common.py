"""Shared by the checkpoint modules: the error type, param paths and progress bars.

Param paths. A leaf of a param tree is named by a tuple of str, one per step
from the root, e.g. `('params', 'layers_0', 'mlp', 'kernel')`:

  * a dict key gives `str(key)`;
  * a list or tuple index gives `str(index)`;
  * an attribute gives its name, except the wrapper attributes `array` (qwix's
    `WithAux(array, how)`) and `value` (Flax's boxed params such as
    `nn.Partitioned`), which are skipped: the path of the Q8Array inside
    `{'kernel': WithAux(array=Q8Array)}` is `('kernel',)`.

Leaves are found with `jax.tree_util.tree_flatten_with_path(tree,
is_leaf=lambda x: isinstance(x, Q8Array))`, so a `Q8Array` is one leaf.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from q8rules.q8_0 import Q8Array

T = TypeVar("T")

WRAPPER_ATTRS = ("array", "value")
"""Attribute names skipped in param paths: qwix's `WithAux.array`, Flax's boxed `.value`."""

AUTO_PROGRESS_MIN = 16
"""`progress=None` shows a bar when more tensors than this go by and stderr is a terminal."""

MAX_LISTED = 20
"""How many items an error message lists before 'and N more'."""


class CheckpointError(ValueError):
  """A checkpoint file, a tensor or a name map that cannot be used as asked.

  The message names the file and the tensor (or param path) concerned.
  """


ParamPath = tuple[str, ...]


def is_q8(x: Any) -> bool:
  """Whether `x` is a Q8Array (the leaf type of Q8 param trees)."""
  return isinstance(x, Q8Array)


def key_name(key: Any) -> str | None:
  """One step of a jax key path as a str, or None for a skipped wrapper attribute."""
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return None if key.name in WRAPPER_ATTRS else key.name
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def param_path(keypath: Sequence[Any]) -> ParamPath:
  """A jax key path as a param path (tuple of str, wrapper attributes skipped)."""
  return tuple(name for key in keypath if (name := key_name(key)) is not None)


def format_path(path: Sequence[str]) -> str:
  """A param path for messages: `layers_0/mlp/kernel`."""
  return "/".join(path) if path else "(root)"


def flatten_params(tree: Any) -> tuple[list[tuple[ParamPath, Any]], Any]:
  """(param path, leaf) pairs in tree order, and the treedef, with Q8Arrays as leaves."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_q8)
  return [(param_path(kp), leaf) for kp, leaf in pairs], treedef


def listing(items: Sequence[str], limit: int = MAX_LISTED) -> str:
  """Items one per line, indented, at most `limit` of them then 'and N more'."""
  lines = [f"  {item}" for item in items[:limit]]
  if len(items) > limit:
    lines.append(f"  ... and {len(items) - limit} more")
  return "\n".join(lines)


def show_progress(progress: bool | None, total: int) -> bool:
  """Resolve `progress=None` (auto): on when `total` > 16 and stderr is a terminal."""
  if progress is not None:
    return bool(progress)
  isatty = getattr(sys.stderr, "isatty", None)
  return total > AUTO_PROGRESS_MIN and bool(isatty and isatty())


def progress_iter(
  items: Iterable[T], *, total: int, desc: str, progress: bool | None
) -> Iterator[T] | Iterable[T]:
  """`items`, wrapped in a tqdm bar (unit: tensors) when `show_progress` says so."""
  if not show_progress(progress, total):
    return items
  from tqdm import tqdm

  return tqdm(items, total=total, desc=desc, unit="tensor", leave=False)


def shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
  """Shape and dtype of an array, a `jax.ShapeDtypeStruct` or a scalar."""
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:
    arr = np.asarray(x)
    return tuple(arr.shape), arr.dtype
  return tuple(int(s) for s in shape), np.dtype(dtype)
