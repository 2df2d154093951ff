"""Shared by the checkpoint modules: the error type, flattening param trees, progress bars.

Param paths are `q8rules.tree_paths`' (a tuple of str per leaf, the wrapper
attributes `array` and `value` skipped). Leaves are found with
`jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_q8)`, so a `Q8Array`
is one leaf.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np

from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.tree_paths import ParamPath, param_path

T = TypeVar("T")

AUTO_PROGRESS_MIN = 16
"""`progress=None` shows a bar when more tensors than this go by and stderr is a terminal."""


class CheckpointError(ValueError):
  """A checkpoint file, a tensor or a name map that cannot be used as asked.

  The message names the file and the tensor (or param path) concerned.
  """


def is_q8(x: Any) -> bool:
  """Whether `x` is a Q8Array (the leaf type of Q8 param trees)."""
  return isinstance(x, Q8Array)


def flatten_params(tree: Any) -> tuple[list[tuple[ParamPath, Any]], Any]:
  """(param path, leaf) pairs in tree order, and the treedef, with Q8Arrays as leaves."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_q8)
  return [(param_path(kp), leaf) for kp, leaf in pairs], treedef


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


def normalize_index(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  """`index` (slices, maybe fewer than axes) as (start, stop) per axis of `shape`; steps of 1."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
  out = []
  for s, size in zip(index, shape, strict=True):
    start, stop, step = s.indices(size)
    if step != 1:
      raise ValueError(f"a shard index must have steps of 1, got {s}")
    out.append((start, max(start, stop)))
  return tuple(out)


def index_slices(bounds: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
  """The inverse of `normalize_index`: (start, stop) per axis -> slices."""
  return tuple(slice(a, b) for a, b in bounds)


def blocked_axis(q_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int:
  """The axis a Q8Array is blocked along, from its shapes (scale's is q's divided by 32):
  stacked params keep the per-layer `axis` field, so the field alone does not say."""
  diff = [i for i, (a, b) in enumerate(zip(q_shape, scale_shape, strict=True)) if a != b]
  if len(diff) != 1 or q_shape[diff[0]] != scale_shape[diff[0]] * BLOCK:
    raise CheckpointError(f"a Q8Array of q {q_shape} and scale {scale_shape} is not Q8_0-shaped")
  return diff[0]


def region_of(value: Any, index: Any) -> Any:
  """A region of a value already read (a Q8Array: `index` over q; its scale rows follow)."""
  if isinstance(value, Q8Array):
    bounds = normalize_index(index, tuple(value.q.shape))
    axis = blocked_axis(tuple(value.q.shape), tuple(value.scale.shape))
    sb = tuple(
      (a // BLOCK, -(-b // BLOCK)) if i == axis else (a, b) for i, (a, b) in enumerate(bounds)
    )
    return Q8Array(
      q=np.asarray(value.q)[index_slices(bounds)],
      scale=np.asarray(value.scale)[index_slices(sb)],
      axis=value.axis,
      dtype=value.dtype,
    )
  value = np.asarray(value)
  return value[index_slices(normalize_index(index, value.shape))]
