"""Q8_0 products per shard, in `shard_map`: each device multiplies what lives on it.

Column-parallel products leave the output split along N; row-parallel ones add
their float32 partial sums over the K mesh axes (`ordered_sum`) before the cast. The
fold is a custom call XLA cannot partition, so it must run per shard; each
shard resolves its implementation from its own shape (`kernels.run_product`).
`run_sharded` is the one runner; `q8_matmul_sharded` (x (..., K) @ W) and the
provider's products (`q8rules.providers.mesh`) only plan its specs.
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


def ordered_sum(partial: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """The sum of `partial` over the mesh `axes`, added in the mesh's device order on every
  device: the same float32 bits whichever processes hold the shards (a `psum`'s order is the
  collective library's: gloo across processes and XLA within one add in different orders).

  Args:
    partial: a device's (m, N_local) float32 partial sum, inside `shard_map`.
    axes: the mesh axes the partial sums are split over.

  Returns:
    (m, N_local) float32, equal on every device of `axes`.
  """
  parts = jax.lax.all_gather(partial, axes)  # (shards, m, N_local), in mesh order
  total = parts[0]
  for i in range(1, parts.shape[0]):
    total = total + parts[i]
  return total


def run_sharded(
  x: jax.Array,
  w: Q8Array,
  mesh: AnyMesh,
  *,
  x_spec: P,
  w_spec: P,
  out_spec: P,
  to_matrix: Callable[[jax.Array], jax.Array] | None = None,
  from_matrix: Callable[[jax.Array, tuple[int, ...]], jax.Array] | None = None,
  implementation: kernels.ImplementationArg = None,
  interpret: bool | None = None,
  act_qtype: str | None = None,
) -> tuple[jax.Array, str]:
  """The one sharded product: each device multiplies the shards it holds, in `shard_map`.

  Each device views its slice of x as (m, K_local) (`to_matrix`; nothing is
  gathered), runs `kernels.run_product` on it and its (K_local, N_local) weight
  shard (the implementation picked from the shard's own shape), adds row-parallel
  float32 partial sums over `w_spec`'s K mesh axes (`ordered_sum`), casts to x's dtype
  and puts its (m, N_local) back into its output shard (`from_matrix`). The fold
  pads a shard's N to its column tile and slices the pad off: per shard, never a
  global pad.

  Args:
    x: the activation, any rank, placed by `x_spec` (its contracted axes split like
      the weight's K).
    w: the (K, N) Q8Array (q int8, scale float32/float16 (K/32, N)).
    mesh: a `Mesh`, or under jit the `AbstractMesh` of an explicitly sharded array.
    x_spec, w_spec, out_spec: validated PartitionSpecs of x, the (K, N) matrix (for q
      and scale alike) and the output.
    to_matrix: a device's x shard -> (m, K_local) (default: `reshape(-1, K_local)`).
    from_matrix: (m, N_local) in x's dtype and the x shard's shape -> the output shard
      (default: `reshape(*x_shard.shape[:-1], N_local)`).
    implementation, interpret, act_qtype: as `kernels.q8_matmul`, per shard (Q8_0 activation
      blocks lie within a K shard: shards are whole blocks).

  Returns:
    The output, split by `out_spec`, and the implementation the shards ran.
  """
  k_axes = mesh_axes(tuple(w_spec)[0])
  ran: list[str] = []

  def per_shard(x_local: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    x2d = to_matrix(x_local) if to_matrix else x_local.reshape(-1, q.shape[0])
    y2d, name = kernels.run_product(
      x2d,
      Q8Array(q, scale),
      implementation=implementation,
      interpret=interpret,
      preferred_element_type=jnp.float32,
      act_qtype=act_qtype,
    )
    ran.append(name)
    if k_axes:  # row-parallel: float32 partial sums, added before the cast
      y2d = ordered_sum(y2d, k_axes)
    y2d = y2d.astype(x_local.dtype)
    if from_matrix:
      return from_matrix(y2d, tuple(x_local.shape))
    return y2d.reshape(*x_local.shape[:-1], q.shape[1])

  f = shard_map_unchecked(per_shard, mesh, in_specs=(x_spec, w_spec, w_spec), out_specs=out_spec)
  y = f(place(x, mesh, x_spec), place(w.q, mesh, w_spec), place(w.scale, mesh, w_spec))
  return y, ran[0]


def q8_matmul_sharded(
  x: jax.Array,
  w: Q8Array,
  mesh: AnyMesh,
  *,
  w_spec: Any,
  x_spec: Any = None,
  implementation: kernels.ImplementationArg = None,
  interpret: bool | None = None,
  act_qtype: str | None = None,
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
    act_qtype: None, or 'q8_0': each shard quantizes its activations to Q8_0 (its K slice is
      whole 32-blocks, so the blocks are the unsharded product's).

  Returns:
    (..., N) in x's dtype, sharded as `P(*x_spec[:-1], w_spec[1])`: columns
    along W's N mesh axes; row-parallel partial sums are added in float32
    over W's K mesh axes (`ordered_sum`) before the cast.
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
  y, _ = run_sharded(
    x,
    w,
    mesh,
    x_spec=P(*xs),
    w_spec=w_spec,
    out_spec=P(*out_entries),
    implementation=implementation,
    interpret=interpret,
    act_qtype=act_qtype,
  )
  assert y.shape == (*x.shape[:-1], w.shape[1]), (y.shape, x.shape, w.shape)
  return y


__all__ = [
  "ordered_sum",
  "place",
  "q8_matmul_sharded",
  "run_sharded",
  "shard_map_unchecked",
  "type_spec",
]
