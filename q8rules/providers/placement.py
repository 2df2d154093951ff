"""Installing a Q8_0 param in its module, with the float param's sharding annotation carried over.

A float weight of any rank becomes the 2-D (K, N) Q8_0 matrix, so its N-D sharding annotation
(nnx `Param(..., sharding=...)`, linen `nn.with_partitioning`) cannot stay as it is (Qwix's
own swap asserts on it). Its axes are translated through the weight's layout: the mesh axes
of the axes flattened into K split K, those of the axes flattened into N split N
(`q8rules.sharding.specs.q8_spec_for_layout`); `q` (K, N) and `scale` (K/32, N) get the same
2-D spec. When a mesh is in context (`jax.set_mesh`), or the float param is placed on one (a
`NamedSharding`), a K split that would cut a 32-row block is refused here, naming the param.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules._qwix import unbox
from q8rules.layout import Q8How, WeightLayout
from q8rules.providers import views
from q8rules.providers.q8_weight import Q8Weight
from q8rules.q8_0 import Q8Array
from q8rules.sharding.specs import check_q8_spec, mesh_axes, q8_spec_for_layout
from q8rules.tree_paths import path_str

NNX_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")
"""Where an nnx Variable keeps its sharding annotation (Flax >= 0.12.4 first)."""

LINEN_SHARDING_FIELDS = ("names", "mesh_axes")
"""Where a linen `AxisMetadata` box keeps its axis names."""


def param_path(module: Any, name: str) -> str:
  """'module/path/name' of the param `name` of `module` (linen or a Qwix-quantized nnx module)."""
  path = module.path if isinstance(module, nn.Module) else getattr(module, "qwix_path", ())
  return path_str((*path, name), skip_wrappers=False)


def annotation(box: Any) -> tuple[Any, ...] | None:
  """The sharding annotation of a boxed float param (one entry per axis), or None."""
  if isinstance(box, nnx.Variable):
    meta = box.get_metadata()
    for key in NNX_SHARDING_KEYS:
      if isinstance(meta.get(key), tuple | list | P):
        return tuple(meta[key])
    return None
  if isinstance(box, nn.meta.AxisMetadata):
    for field in LINEN_SHARDING_FIELDS:
      if isinstance(getattr(box, field, None), tuple | list | P):
        return tuple(getattr(box, field))
  return None


def stored_layout(layout: WeightLayout, chain: views.Chain, entries: Any) -> WeightLayout:
  """The layout a param is stored in: `layout` with an annotated split of a free axis moved to
  the front of N (so it splits a contiguous range), when the views in `chain` still apply."""
  if entries is None:
    return layout
  moved = views.free_order_for(layout, entries)
  try:
    views.forward_layout(moved, chain)
  except views.ViewError:
    return layout
  return moved


def q8_annotation(layout: WeightLayout, entries: Any, what: str) -> P | None:
  """The 2-D (K, N) spec of a Q8 param whose float param has the annotation `entries`."""
  if entries is None or all(e is None for e in entries):
    return None
  return q8_spec_for_layout(layout, P(*entries), what=what)


def current_mesh() -> Any:
  """The mesh `jax.set_mesh` put in context, or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def placed_sharding(x: Any) -> NamedSharding | None:
  """The `NamedSharding` a concrete array `x` is placed by, or None (a tracer, another kind of
  sharding, not an array)."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
      return sharding
  return None


def placed_mesh(x: Any) -> Any:
  """The mesh a concrete array `x` is placed on (its `NamedSharding`'s), or None."""
  sharding = placed_sharding(x)
  return None if sharding is None else sharding.mesh


def check_on_mesh(
  q_shape: tuple[int, ...], spec: P | None, what: str, placed_on: Any = None
) -> None:
  """Refuse, naming the param, a spec that the mesh in context, else the mesh `placed_on`
  (the float param's, `placed_mesh`), cannot split Q8_0 values by (a K split cutting a 32-row
  block, an N split that does not divide N)."""
  mesh = current_mesh()
  if mesh is None:
    mesh = placed_on
  if spec is None or mesh is None:
    return
  named = {a for e in spec for a in mesh_axes(e)}
  if named - set(mesh.axis_names):  # logical names: resolved by the user's rules, later
    return
  check_q8_spec(q_shape, spec, mesh, what=what)


def box_like(box: Any, leaf: jax.Array, spec: P | None) -> Any:
  """`leaf` in a box like the float param's, its sharding annotation replaced by `spec`."""
  if isinstance(box, nnx.Variable):
    meta = dict(box.get_metadata())
    for key in NNX_SHARDING_KEYS:
      if key in meta and spec is not None:
        meta[key] = type(meta[key])(spec) if isinstance(meta[key], tuple | list) else spec
    return type(box).from_metadata(leaf, meta)
  if isinstance(box, nn.meta.AxisMetadata):
    boxed = box.replace_boxed(leaf)
    for field in LINEN_SHARDING_FIELDS:
      if spec is not None and isinstance(getattr(boxed, field, None), tuple | list | P):
        boxed = dataclasses.replace(boxed, **{field: tuple(spec)})
    return boxed
  return leaf


def install(
  module: Any,
  name: str,
  base: jax.Array,
  how: Q8How,
  quantize: Callable[[jax.Array, Q8How, str], Q8Array],
) -> Q8Weight:
  """Quantize the float param `name` of `module` (value `base`, laid out by `how`) and put the
  Q8 param in its place, its sharding annotation carried over.

  Replaces Qwix's `create_quantized_param` (which keeps the float param's N-D annotation on
  the 2-D values). Linen: only while the module initializes (the Q8 model's `init`).

  Returns:
    The unboxed stored `Q8Weight`.
  """
  what = param_path(module, name)
  if isinstance(module, nn.Module):
    if not module.is_initializing():
      raise ValueError(
        f"{what}: an unquantized param to a quantized model (a rule serves this weight as"
        " Q8_0): give it Q8 params, from `q8rules.quantize_params(float_params,"
        " abstract_q8_params)` or its own `init`"
      )
    box = module.get_variable("params", name)
  else:
    box = getattr(module, name)
  spec = q8_annotation(how.layout, annotation(box), what)
  q8 = quantize(base, how, what)
  check_on_mesh(tuple(q8.q.shape), spec, what, placed_mesh(base))
  weight = Q8Weight(array=q8, how=how, name=what)
  boxed = jax.tree.map(lambda leaf: box_like(box, leaf, spec), weight)
  if isinstance(module, nn.Module):
    module.put_variable("params", name, boxed)
  else:
    setattr(module, name, boxed)
  return unbox(boxed)


__all__ = [
  "annotation",
  "box_like",
  "check_on_mesh",
  "current_mesh",
  "install",
  "param_path",
  "placed_mesh",
  "placed_sharding",
  "q8_annotation",
  "stored_layout",
]
