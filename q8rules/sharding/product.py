"""Q8_0 products per shard, in `shard_map`: each device multiplies what lives on it.

Column-parallel products leave the output split along N; row-parallel ones add
their float32 partial sums over the K mesh axes (`psum`) before the cast. The
fold is a custom call XLA cannot partition, so it must run per shard; each
shard resolves its implementation from its own shape (`kernels.resolve`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules import kernels
from q8rules.q8_0 import Q8Array
from q8rules.sharding.specs import (
  AnyMesh,
  check_q8_spec,
  check_spec_axes,
  devices_along,
  mesh_axes,
  spec_entries,
)


def shard_map_unchecked(
  f: Callable[..., Any], mesh: AnyMesh, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
  """`jax.shard_map` without the replication check (the Pallas fold's output carries no
  varying-axes type)."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def local_product(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  implementation: kernels.ImplementationArg,
  interpret: bool | None,
) -> jax.Array:
  """One device's product on its shards: x2d (m, K_local) @ (q, scale) -> (m, N_local) float32.

  The implementation is picked from the shard's own shape; the fold pads this
  shard's N to its column tile (zero values and scales) and slices the pad off:
  per shard, never a global pad.
  """
  return kernels.q8_matmul(
    x2d,
    Q8Array(q, scale),
    implementation=implementation,
    interpret=interpret,
    preferred_element_type=jnp.float32,
  )


def type_spec(a: Any) -> P | None:
  """The spec in `a`'s type when its mesh has explicit axes (sharding in types), else None."""
  try:
    sharding = jax.typeof(a).sharding
  except (AttributeError, TypeError):
    return None
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not getattr(mesh, "explicit_axes", ()):
    return None
  return sharding.spec


def place(a: jax.Array, mesh: AnyMesh, spec: P) -> jax.Array:
  """`a` laid out by `spec` on `mesh`: a device_put (a sharding constraint under jit)."""
  if isinstance(mesh, Mesh):
    return jax.device_put(a, NamedSharding(mesh, spec))
  current = type_spec(a)
  if current is not None and spec_entries(current, a.ndim, "x") == spec_entries(spec, a.ndim, "x"):
    return a
  return jax.sharding.reshard(a, NamedSharding(mesh, spec))


def q8_matmul_sharded(
  x: jax.Array,
  w: Q8Array,
  mesh: AnyMesh,
  *,
  w_spec: Any,
  x_spec: Any = None,
  implementation: kernels.ImplementationArg = None,
  interpret: bool | None = None,
) -> jax.Array:
  """`y = x @ W` with W's (K, N) matrix split over `mesh` by `w_spec`, per shard in `shard_map`.

  Args:
    x: (..., K) float32, bfloat16 or float16 activations.
    w: the (K, N) Q8Array (q int8 (K, N), scale float32/float16 (K/32, N)).
    mesh: the device mesh (a `Mesh`, or under jit the `AbstractMesh` of an
      explicitly sharded array).
    w_spec: the PartitionSpec of the (K, N) matrix: `P(None, 'tp')`
      column-parallel, `P('tp', None)` row-parallel (both at once,
      `P('a', 'b')`, is allowed too).
    x_spec: the PartitionSpec of x; its last (K) entry must be `w_spec`'s K
      entry. Default: x's K axis split like W's K, its other axes replicated
      (`P()` for column-parallel: every device holds the whole activation).
      Leading axes may be split along other mesh axes (data parallel).
    implementation: as `q8_matmul` ('xla', 'pallas', 'reference', None), chosen
      per shard from the shard's shape when None.
    interpret: Pallas interpret mode for the fold (None: on CPU).

  Returns:
    (..., N) in x's dtype, sharded as `P(*x_spec[:-1], w_spec[1])`: columns
    along W's N mesh axes; row-parallel partial sums are added in float32
    over W's K mesh axes (`psum`) before the cast.
  """
  kernels.check_operands(x, w, what="q8_matmul_sharded")
  kernels.check_implementation(implementation)
  w_spec = check_q8_spec(w.shape, w_spec, mesh, what=f"q8_matmul_sharded: weight {w.shape}")
  k_entry, n_entry = tuple(w_spec)
  xs = spec_entries(x_spec, x.ndim, f"q8_matmul_sharded: x {tuple(x.shape)}")
  if x_spec is None:
    xs = xs[:-1] + (k_entry,)
  if mesh_axes(xs[-1]) != mesh_axes(k_entry):
    raise ValueError(
      f"q8_matmul_sharded: x_spec {P(*xs)} splits x's K axis over {mesh_axes(xs[-1])} but the"
      f" weight's K is split over {mesh_axes(k_entry)} (w_spec {w_spec}); they must match"
    )
  out_entries = xs[:-1] + (n_entry,)
  check_spec_axes(out_entries, f"q8_matmul_sharded: output spec {P(*out_entries)}")
  for size, e in zip(x.shape[:-1], xs[:-1], strict=True):
    d = devices_along(mesh, e, "q8_matmul_sharded: x_spec")
    if size % d:
      raise ValueError(
        f"q8_matmul_sharded: x of shape {tuple(x.shape)}: an axis of size {size} does not"
        f" split over {d} devices ({e!r})"
      )
  x_spec, out_spec = P(*xs), P(*out_entries)
  k_axes = mesh_axes(k_entry)
  n = w.shape[1]

  def per_shard(x_local: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    lead = x_local.shape[:-1]
    y = local_product(x_local.reshape(-1, q.shape[0]), q, scale, implementation, interpret)
    if k_axes:  # row-parallel: float32 partial sums, added before the cast
      y = jax.lax.psum(y, k_axes)
    return y.astype(x_local.dtype).reshape(*lead, q.shape[1])

  x = place(x, mesh, x_spec)
  q = place(w.q, mesh, w_spec)
  scale = place(w.scale, mesh, w_spec)
  f = shard_map_unchecked(per_shard, mesh, in_specs=(x_spec, w_spec, w_spec), out_specs=out_spec)
  y = f(x, q, scale)
  assert y.shape == (*x.shape[:-1], n), (y.shape, x.shape, n)
  return y


__all__ = ["local_product", "place", "q8_matmul_sharded", "shard_map_unchecked", "type_spec"]
