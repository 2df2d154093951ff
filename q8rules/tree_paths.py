"""Names of leaves in param trees, and listings of names in error messages.

A leaf of a param tree is named by a tuple of str, one per step from the root,
e.g. `('params', 'layers_0', 'mlp', 'kernel')`:

  * a dict key gives `str(key)`;
  * a list or tuple index gives `str(index)`;
  * an attribute gives its name, except the wrapper attributes `array` (Qwix's
    `WithAux(array, how)`) and `value` (Flax's boxed params such as
    `nn.Partitioned`), which are skipped: the path of the Q8Array inside
    `{'kernel': WithAux(array=Q8Array)}` is `('kernel',)`.

`path_str` joins such a path with '/' ('layers_0/mlp/kernel'), the form rules,
specs and error messages use. Every module that names a param goes through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax

ParamPath = tuple[str, ...]

WRAPPER_ATTRS = ("array", "value")
"""Attribute names skipped in param paths: Qwix's `WithAux.array`, Flax's boxed `.value`."""

MAX_LISTED = 20
"""How many items an error message lists before 'and N more'."""


def key_name(key: Any, *, skip_wrappers: bool = True) -> str | None:
  """One step of a jax key path (or a plain name) as a str; None for a skipped wrapper attribute."""
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return None if skip_wrappers and key.name in WRAPPER_ATTRS else key.name
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def param_path(keypath: Iterable[Any], *, skip_wrappers: bool = True) -> ParamPath:
  """A jax key path (or a tuple of names) as a param path: a tuple of str."""
  return tuple(
    name for key in keypath if (name := key_name(key, skip_wrappers=skip_wrappers)) is not None
  )


def path_str(path: Iterable[Any], *, skip_wrappers: bool = True) -> str:
  """A key path or param path as 'a/b/c' ('(root)' for the empty path)."""
  return "/".join(param_path(path, skip_wrappers=skip_wrappers)) or "(root)"


def listing(items: Sequence[str], limit: int = MAX_LISTED) -> str:
  """Items one per line, indented, at most `limit` of them then 'and N more'."""
  lines = [f"  {item}" for item in items[:limit]]
  if len(items) > limit:
    lines.append(f"  ... and {len(items) - limit} more")
  return "\n".join(lines)


__all__ = [
  "MAX_LISTED",
  "WRAPPER_ATTRS",
  "ParamPath",
  "key_name",
  "listing",
  "param_path",
  "path_str",
]
