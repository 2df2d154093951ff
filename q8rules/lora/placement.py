"""A new LoRA adapter gets its Q8_0 base's sharding: the base's annotation and placement.

When `Q8LoraProvider` creates `<name>_lora_a` (K, rank) or `<name>_lora_b` (rank, N) beside the
Q8 param `<name>`, the adapter follows the base's (K, N) split (`q8rules.sharding.adapters`:
A takes K's entry, B takes N's, the rank axis stays whole), as Qwix's `LoraProvider` copies
its weight's sharding onto lora_a / lora_b:

  * its annotation: the base's Q8 values' 2-D annotation (nnx sharding metadata, linen
    `nn.Partitioned` names, as `q8rules.providers.placement` made them from the float param's)
    becomes the adapter's, with the rest of the base's metadata;
  * its placement: where the base's values are a placed array (a `NamedSharding`), or a traced
    one whose type carries an explicit mesh, the adapter is put on that mesh the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules._qwix import get_current_module, unbox
from q8rules.providers.placement import (
  NNX_SHARDING_KEYS,
  annotation,
  box_like,
  current_mesh,
  placed_sharding,
)
from q8rules.sharding.adapters import Which, adapter_entries, adapter_spec
from q8rules.sharding.product import type_spec
from q8rules.sharding.specs import AnyMesh, devices_along, spec_entries


def base_values(name: str) -> Any:
  """The Q8 values `q` (K_padded, N), boxed as stored, of the current module's Q8 param `name`;
  None when there is none to read (a weight read in place, as a `LayerSlice`)."""
  module = get_current_module()
  if isinstance(module, nn.Module):
    param = module.get_variable("params", name) if module.has_variable("params", name) else None
  else:
    param = getattr(module, name, None)
  return getattr(getattr(param, "array", None), "q", None)


def _mesh_and_spec(q: Any) -> tuple[AnyMesh, tuple[Any, ...]] | None:
  """The mesh and spec entries the Q8 values `q` are laid out by: a placed array's
  `NamedSharding`, or the sharding in a traced array's type (explicit mesh axes); else None."""
  if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
    sharding = placed_sharding(q)
    return (
      None
      if sharding is None
      else (sharding.mesh, spec_entries(sharding.spec, q.ndim, "Q8 values"))
    )
  typed = type_spec(q)
  if typed is None:
    return None
  return jax.typeof(q).sharding.mesh, spec_entries(typed, q.ndim, "Q8 values")


def place_like_base(value: jax.Array, q: Any, which: Which, where: str) -> jax.Array:
  """The adapter `value` (A (K, rank) or B (rank, N)) put on the mesh the base's Q8 values `q`
  are laid out on, split as they are (`adapter_spec`); `value` itself when they are not.

  Raises ValueError, naming the op, when the base's split does not divide the adapter's axis
  (A's unpadded K when the Q8 values' padded K is split)."""
  found = _mesh_and_spec(q)
  if found is None:
    return value
  mesh, base = found
  spec = adapter_spec(base, which, value.ndim)
  for size, entry in zip(value.shape, spec, strict=True):
    d = devices_along(mesh, entry, where)
    if size % d:
      raise ValueError(
        f"{where}: cannot split LoRA {which.upper()} of shape {tuple(value.shape)} as its Q8_0"
        f" base is split ({spec}): an axis of {size} over {d} devices"
      )
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.device_put(value, NamedSharding(mesh, spec))
  return jax.sharding.reshard(value, NamedSharding(mesh, spec))


def _nnx_metadata(box: nnx.Variable, entries: tuple[Any, ...]) -> nnx.VariableMetadata:
  """The base's nnx metadata with its sharding annotation replaced by `entries` (eager sharding
  left off when no mesh is in context to resolve it: `place_like_base` placed the value)."""
  meta = dict(box.get_metadata())
  for key in NNX_SHARDING_KEYS:
    if isinstance(meta.get(key), P):
      meta[key] = P(*entries)
    elif isinstance(meta.get(key), tuple | list):
      meta[key] = type(meta[key])(entries)
  if current_mesh() is None and meta.get("mesh") is None:
    meta["eager_sharding"] = False
  return meta


def boxed_like_base(value: jax.Array, box: Any, which: Which) -> Any:
  """`value` as the init of an adapter param, annotated as the base's boxed Q8 values `box`
  are, through `adapter_entries` (nnx: a `VariableMetadata` that `get_or_create_param` makes
  the `nnx.LoRAParam` from; linen: a box like the base's); `value` itself when the base has
  no annotation."""
  entries = annotation(box)
  if entries is None:
    return value
  entries = adapter_entries(entries, which, len(entries))
  if isinstance(box, nnx.Variable):
    return nnx.VariableMetadata(value, metadata=_nnx_metadata(box, entries))
  return box_like(box, value, P(*entries))


def init_like_base(
  init: Callable[[jax.Array], jax.Array], name: str, which: Which, where: str
) -> Callable[[jax.Array], Any]:
  """`init(key)` -> the adapter's first value, placed and annotated as the current module's Q8
  param `name` is (`place_like_base`, `boxed_like_base`)."""

  def run(key: jax.Array) -> Any:
    box = base_values(name)
    value = place_like_base(init(key), unbox(box), which, where)
    return boxed_like_base(value, box, which)

  return run


__all__ = ["base_values", "boxed_like_base", "init_like_base", "place_like_base"]
