"""PartitionSpecs for Q8_0 weights: one spec on the (K, N) matrix splits `q` and `scale` alike.

Column-parallel `P(None, 'tp')` leaves each device q (K, N/d) and scale
(K/32, N/d); row-parallel `P('tp', None)` leaves q (K/d, N) and scale
(K/32/d, N), whole 32-row blocks only (a split that cuts a block is refused).
A float weight's spec translates through its layout (`q8_spec_for_layout`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules.layout import WeightLayout
from q8rules.q8_0 import BLOCK, Q8Array

AnyMesh = Mesh | AbstractMesh
SpecKey = str | tuple[Any, ...]
"""A key of `specs`: a '/'-joined param path, a regex on it (`re.fullmatch`), or a path tuple."""


def mesh_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one PartitionSpec entry names: None -> (), 'tp' -> ('tp',)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, tuple | list):
    return tuple(entry)
  raise TypeError(f"a PartitionSpec entry must be None, a mesh axis name or a tuple, got {entry!r}")


def _entry(axes: tuple[str, ...]) -> Any:
  """The inverse of `_axes`: () -> None, ('tp',) -> 'tp'."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def spec_entries(spec: Any, ndim: int, what: str) -> tuple[Any, ...]:
  """The spec's entries padded with None to `ndim`; an error when it is longer."""
  if spec is None:
    spec = P()
  if not isinstance(spec, P):
    raise TypeError(f"{what}: expected a jax.sharding.PartitionSpec, got {spec!r}")
  entries = tuple(spec)
  if len(entries) > ndim:
    raise ValueError(f"{what}: PartitionSpec {spec} has {len(entries)} entries for {ndim} axes")
  return entries + (None,) * (ndim - len(entries))


def _mesh_shape(mesh: AnyMesh) -> dict[str, int]:
  return dict(mesh.shape)


def devices_along(mesh: AnyMesh, entry: Any, what: str) -> int:
  """How many pieces `entry` splits an axis into on `mesh`; an error for unknown axes."""
  shape = _mesh_shape(mesh)
  axes = mesh_axes(entry)
  for a in axes:
    if a not in shape:
      raise ValueError(f"{what}: mesh axis {a!r} is not in the mesh (axes {tuple(shape)})")
  return math.prod(shape[a] for a in axes)


def check_spec_axes(entries: tuple[Any, ...], what: str) -> None:
  seen: list[str] = []
  for e in entries:
    for a in mesh_axes(e):
      if a in seen:
        raise ValueError(f"{what}: mesh axis {a!r} is used twice in {P(*entries)}")
      seen.append(a)


def check_q8_spec(
  shape: tuple[int, ...], spec: Any, mesh: AnyMesh, *, what: str = "Q8 weight"
) -> P:
  """Validate a PartitionSpec for a Q8_0 weight's values of `shape` (..., K, N) on `mesh`.

  Leading axes (layers stacked by `nn.scan`) may be split too. K must split into
  whole 32-row blocks per device and N evenly.

  Returns:
    The spec, padded with None to the weight's rank.
  """
  if len(shape) < 2:
    raise ValueError(f"{what}: a Q8_0 weight is (K, N), got shape {tuple(shape)}")
  entries = spec_entries(spec, len(shape), what)
  check_spec_axes(entries, what)
  *lead, k, n = shape
  for i, (size, e) in enumerate(zip(lead, entries[:-2], strict=True)):
    d = devices_along(mesh, e, what)
    if size % d:
      raise ValueError(
        f"{what}: cannot split leading axis {i} of size {size} over {d} devices ({e!r})"
      )
  dk = devices_along(mesh, entries[-2], what)
  dn = devices_along(mesh, entries[-1], what)
  if k % (BLOCK * dk):
    raise ValueError(
      f"{what}: cannot split K={k} rows of a Q8_0 weight of shape {tuple(shape)} over"
      f" {dk} devices (mesh axes {mesh_axes(entries[-2])}): {k / dk:g} rows per device"
      f" {'cuts a' if k % dk == 0 else 'is not a whole number of'} {BLOCK}-row block"
      f"{'' if k % dk == 0 else 's'}; K must be a multiple of {BLOCK * dk}"
      f" ({k // BLOCK} blocks do not divide by {dk})"
    )
  if n % dn:
    raise ValueError(
      f"{what}: cannot split N={n} columns of a Q8_0 weight of shape {tuple(shape)} over"
      f" {dn} devices (mesh axes {mesh_axes(entries[-1])}): N must be a multiple of {dn}"
    )
  return P(*entries)


def q8_sharding(mesh: Mesh, spec: Any, like: Q8Array | None = None) -> Q8Array:
  """The NamedShardings of a Q8_0 weight whose (K, N) matrix is split by `spec`.

  Args:
    mesh: the device mesh.
    spec: the PartitionSpec of the float (K, N) weight (e.g. `P(None, 'tp')`).
    like: the Q8Array to be placed (its shape is validated and its static
      fields copied, so the result is a sharding tree of the same structure
      for `jax.device_put` or `jax.jit(..., in_shardings=...)`). Without it,
      a 2-D float32 weight blocked along axis 0 is assumed.

  Returns:
    A `Q8Array` whose `q` and `scale` are `NamedSharding(mesh, spec)`: the same
    spec for both, so `scale`'s K/32 rows split along the same mesh axes as
    `q`'s K rows.
  """
  if like is not None:
    if like.axis != like.ndim - 2:
      raise ValueError(
        f"q8_sharding: the Q8 weight must be blocked along its K axis ({like.ndim - 2}),"
        f" got axis {like.axis} for shape {like.shape}"
      )
    spec = check_q8_spec(like.shape, spec, mesh, what=f"Q8 weight {like.shape}")
  s = NamedSharding(mesh, spec if spec is not None else P())
  if like is None:
    return Q8Array(q=s, scale=s)
  return dataclasses.replace(like, q=s, scale=s)


def shard_q8(a: Q8Array, mesh: Mesh, spec: Any) -> Q8Array:
  """Place a Q8_0 weight on `mesh`, its (K, N) matrix split by `spec` (see `q8_sharding`).

  Column-parallel `P(None, 'tp')` leaves q (K, N/d) and scale (K/32, N/d) on each
  device; row-parallel `P('tp', None)` leaves q (K/d, N) and scale (K/32/d, N).
  """
  return jax.device_put(a, q8_sharding(mesh, spec, like=a))


def q8_spec_for_layout(layout: WeightLayout, spec: Any, *, what: str = "weight") -> P:
  """Translate a float weight's PartitionSpec into its (K, N) Q8_0 matrix's.

  The float weight's contraction axes (`layout.contract`, flattened into K in
  that order) and free axes (`layout.free`, into N) each may have one split
  axis, and it must be the leading axis of its group that is longer than 1,
  so that the split is a contiguous range of K (or N) on each device. A
  spec splitting a contraction axis splits K (row-parallel); one splitting a
  free axis splits N (column-parallel). E.g. attention's `(D, heads, H)`
  weight `P(None, 'tp', None)` -> `(D, heads*H)` `P(None, 'tp')`. A stack of experts
  (`layout.batch`) keeps its expert axes' entries in front: `(E, D, F)` `P('ep', None, 'tp')`
  -> `(E, D, F)` `P('ep', None, 'tp')` (expert parallel).
  """
  entries = spec_entries(spec, len(layout.shape), f"{what} {layout.shape}")
  check_spec_axes(entries, f"{what} {layout.shape}")

  def group(axes: tuple[int, ...], name: str) -> Any:
    split = [a for a in axes if entries[a] is not None]
    if not split:
      return None
    if len(split) > 1:
      raise ValueError(
        f"{what}: PartitionSpec {P(*entries)} splits several axes {tuple(split)} of the"
        f" float weight {layout.shape} that flatten into Q8_0's {name}; split one"
      )
    a = split[0]
    before = [b for b in axes[: axes.index(a)] if layout.shape[b] > 1]
    if before:
      raise ValueError(
        f"{what}: PartitionSpec {P(*entries)} splits axis {a} of the float weight"
        f" {layout.shape}, which is not the leading axis of those flattened into {name}"
        f" (axes {axes}); the split would not be a contiguous range of {name}"
      )
    return entries[a]

  k_entry = group(layout.contract, "K")
  if k_entry is not None and layout.k_padded != layout.k:
    raise ValueError(
      f"{what}: cannot split K={layout.k} of the float weight {layout.shape}: it is not"
      f" a multiple of {BLOCK} (the Q8_0 weight is padded to {layout.k_padded} rows)"
    )
  return P(*(entries[a] for a in layout.batch), k_entry, group(layout.free, "N"))


__all__ = [
  "AnyMesh",
  "SpecKey",
  "check_q8_spec",
  "check_spec_axes",
  "devices_along",
  "mesh_axes",
  "q8_sharding",
  "q8_spec_for_layout",
  "shard_q8",
  "spec_entries",
]
