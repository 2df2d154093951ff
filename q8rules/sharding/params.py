"""Placing a Q8 param tree on a mesh, given the PartitionSpecs its float weights would have."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules._qwix import WithAux
from q8rules.layout import Q8How
from q8rules.q8_0 import Q8Array
from q8rules.sharding.adapters import adapter_of, adapter_spec
from q8rules.sharding.specs import (
  AnyMesh,
  SpecKey,
  check_q8_spec,
  check_spec_axes,
  devices_along,
  q8_spec_for_layout,
  spec_entries,
)
from q8rules.tree_paths import param_path, path_str


@dataclasses.dataclass
class SpecTable:
  """`specs` with their keys compiled, and which keys matched something."""

  specs: Mapping[SpecKey, Any]
  used: set[int] = dataclasses.field(default_factory=set)

  def __post_init__(self) -> None:
    self._keys: list[tuple[str, re.Pattern[str] | None, Any]] = []
    for key, spec in self.specs.items():
      if isinstance(key, tuple):
        text, pattern = path_str(key), None
      elif isinstance(key, str):
        try:
          text, pattern = key, re.compile(key)
        except re.error:
          text, pattern = key, None
      else:
        raise TypeError(f"specs: a key must be a '/'-joined path, a regex or a tuple, got {key!r}")
      if spec is not None and not isinstance(spec, P):
        raise TypeError(f"specs[{key!r}]: expected a PartitionSpec, got {spec!r}")
      self._keys.append((text, pattern, spec))

  def lookup(self, path: str) -> Any | None:
    """The spec for `path`: an exact key first, else the first regex that fully matches."""
    for i, (text, _, spec) in enumerate(self._keys):
      if text == path:
        self.used.add(i)
        return spec if spec is not None else P()
    for i, (_, pattern, spec) in enumerate(self._keys):
      if pattern is not None and pattern.fullmatch(path):
        self.used.add(i)
        return spec if spec is not None else P()
    return None

  def check_all_used(self) -> None:
    unused = [text for i, (text, _, _) in enumerate(self._keys) if i not in self.used]
    if unused:
      raise ValueError(f"specs: these keys matched no param: {unused}")


def is_q8_param(x: Any) -> bool:
  return isinstance(x, WithAux) and isinstance(x.how, Q8How) and isinstance(x.array, Q8Array)


def q8_param_spec(param: Any, spec: Any, mesh: AnyMesh, name: str) -> P:
  """The (…, K, N) spec of a Q8 param `WithAux(Q8Array, Q8How)` given its float weight's spec.

  Weights stacked by `nn.scan`/`nn.vmap` carry leading layer axes on both the
  float weight and the Q8Array; their spec entries carry over unchanged.
  """
  layout = param.how.layout
  q_shape = tuple(param.array.q.shape)
  lead = len(q_shape) - len(layout.stored_shape)  # stacked layers (a stack's experts: its own)
  entries = spec_entries(spec, lead + len(layout.shape), f"{name} (float shape {layout.shape})")
  kn = q8_spec_for_layout(layout, P(*entries[lead:]), what=name)
  return check_q8_spec(q_shape, P(*entries[:lead], *kn), mesh, what=name)


def _float_param_spec(leaf: Any, spec: Any, mesh: AnyMesh, name: str) -> P:
  """The spec of a param that is not Q8 (a bias, a float weight), validated."""
  shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
  entries = spec_entries(spec, len(shape), f"{name} of shape {shape}")
  check_spec_axes(entries, name)
  for size, e in zip(shape, entries, strict=True):
    d = devices_along(mesh, e, name)
    if size % d:
      raise ValueError(
        f"{name}: cannot split an axis of size {size} of shape {shape} over {d} devices ({e!r})"
      )
  return P(*entries)


def _adapter_spec(keys: tuple[str, ...], q8_specs: Mapping[tuple[str, ...], P]) -> P | None:
  """The spec of a LoRA adapter at `keys` ('up', 'kernel_lora_a') that follows its Q8 base's
  (`q8rules.sharding.adapters`), or None when `keys` is not an adapter of a Q8 param."""
  found = adapter_of(keys[-1]) if keys else None
  if found is None:
    return None
  base = q8_specs.get((*keys[:-1], found[0]))
  return None if base is None else adapter_spec(base, found[1], len(base))


def _nnx_q8_params(module: Any) -> dict[tuple[str, ...], Any]:
  """Paths (attribute names) of the `WithAux(Q8Array, Q8How)` nodes of an nnx module."""
  found: dict[tuple[str, ...], Any] = {}
  for path, node in nnx.iter_graph(module):
    if is_q8_param(node):
      found[param_path(path)] = node
  return found


def param_shardings(
  params: Any, mesh: Mesh, specs: Mapping[SpecKey, Any], *, strict: bool = True
) -> Any:
  """The NamedSharding of every leaf of a Q8 param tree, given float-weight PartitionSpecs.

  Args:
    params: a linen param tree (e.g. `variables['params']`, from `init` or
      `quantize_params`, concrete or abstract) whose Q8 weights are
      `WithAux(Q8Array, Q8How)`.
    mesh: the device mesh.
    specs: param path ('/'-joined, e.g. 'block_0/mlp/up/kernel'; or a regex
      fully matching such paths; or a path tuple) -> the PartitionSpec the
      *float* weight would have (e.g. `P(None, 'tp')` on a Dense kernel
      (in, out)). An exact key wins over regexes; among regexes the first in
      the mapping's order. For a Q8 weight the spec is translated through its
      layout (`q8_spec_for_layout`) and applies to both q and scale. Params
      no key matches are replicated, except LoRA adapters (`<name>_lora_a`, `<name>_lora_b`
      beside a Q8 param `<name>`, `q8rules.Q8LoraProvider`), which follow their base:
      A (K, rank) split along K as a row-parallel base is, B (rank, N) along N as a
      column-parallel base is (`q8rules.sharding.adapters`; a key naming one wins).
    strict: raise when a key of `specs` matches no param (a typo).

  Returns:
    A tree of the same structure as `params` with a `NamedSharding` per leaf
    (for `jax.device_put`, or `jax.jit(..., out_shardings=...)` to quantize
    straight onto the mesh).
  """
  table = SpecTable(specs)
  q8_specs = {
    param_path(path): q8_param_spec(leaf, table.lookup(path_str(path)), mesh, path_str(path))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_q8_param)
    if is_q8_param(leaf)
  }

  def one(path: tuple[Any, ...], leaf: Any) -> Any:
    keys, name = param_path(path), path_str(path)
    if is_q8_param(leaf):
      s = NamedSharding(mesh, q8_specs[keys])
      return leaf.replace(array=dataclasses.replace(leaf.array, q=s, scale=s))
    spec = table.lookup(name)
    if spec is None:
      spec = _adapter_spec(keys, q8_specs)
    return NamedSharding(mesh, _float_param_spec(leaf, spec, mesh, name))

  out = jax.tree_util.tree_map_with_path(one, params, is_leaf=is_q8_param)
  if strict:
    table.check_all_used()
  return out


def shard_params(
  params: Any, mesh: Mesh, specs: Mapping[SpecKey, Any], *, strict: bool = True
) -> Any:
  """Place a Q8 param tree on `mesh` (see `param_shardings` for `specs`).

  Args:
    params: a linen param tree with `WithAux(Q8Array, Q8How)` Q8 weights, or
      an nnx model quantized by `qwix.quantize_model` (its params are placed
      in place, with paths of attribute names, e.g. 'up/kernel').
    mesh, specs, strict: as `param_shardings`.

  Returns:
    The placed param tree (linen), or the same nnx model with placed params.
  """
  try:
    is_nnx = isinstance(params, nnx.Module)
  except ImportError:  # pragma: no cover
    is_nnx = False
  if not is_nnx:
    return jax.device_put(params, param_shardings(params, mesh, specs, strict=strict))

  q8 = _nnx_q8_params(params)
  pure = nnx.to_pure_dict(nnx.state(params, nnx.Param))
  table = SpecTable(specs)
  q8_specs = {
    keys: q8_param_spec(node, table.lookup(path_str(keys)), mesh, path_str(keys))
    for keys, node in q8.items()
  }

  def one(path: tuple[Any, ...], leaf: Any) -> Any:
    keys = param_path(path)
    if len(keys) > 2 and keys[-2] == "array" and keys[:-2] in q8:
      spec = q8_specs[keys[:-2]]
    else:
      name = path_str(keys)
      float_spec = table.lookup(name)
      if float_spec is None:
        float_spec = _adapter_spec(keys, q8_specs)
      spec = _float_param_spec(leaf, float_spec, mesh, name)
    return jax.device_put(leaf, NamedSharding(mesh, spec))

  placed = jax.tree_util.tree_map_with_path(one, pure)
  if strict:
    table.check_all_used()
  nnx.update(params, placed)
  return params


__all__ = [
  "SpecTable",
  "is_q8_param",
  "param_shardings",
  "path_str",
  "q8_param_spec",
  "shard_params",
]
