"""How a provider runs a product on a Q8 weight (`run_served`): per shard where a mesh splits
the weight, else whole through `kernels.run_product`.

The mesh context: `shard_products(mesh, specs)` makes `Q8Provider` run each matched product
per shard. `plan_product` only plans (the specs of the activation, the (K, N) matrix and the
output); `q8rules.sharding.product.run_sharded` runs; `provider_product` does both.

Without the context, a weight whose type carries an explicit mesh (sharding in
types) is split the same way; otherwise XLA's own partitioning applies.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from q8rules import kernels
from q8rules._qwix import WithAux, current_module_path, find_param
from q8rules.kernels.layer import LayerSlice
from q8rules.layout import ProductLayout, WeightLayout
from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.rules import Q8Rule
from q8rules.sharding.params import SpecTable
from q8rules.sharding.product import run_sharded, type_spec
from q8rules.sharding.specs import (
  AnyMesh,
  SpecKey,
  check_q8_spec,
  devices_along,
  mesh_axes,
  q8_spec_for_layout,
  spec_entries,
)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """What `shard_products` sets: the mesh, the float-weight specs, the activation rows' split."""

  mesh: Mesh
  specs: Mapping[SpecKey, Any]
  batch: Any = None


_PLAN: contextvars.ContextVar[MeshPlan | None] = contextvars.ContextVar(
  "q8_mesh_plan", default=None
)


@contextlib.contextmanager
def shard_products(
  mesh: Mesh, specs: Mapping[SpecKey, Any], *, batch: Any = None
) -> Iterator[MeshPlan]:
  """Inside this context, `Q8Provider` runs each Q8 product whose weight `specs` splits
  per shard on `mesh` (in `shard_map`, see `provider_product`).

  It also enters `jax.set_mesh(mesh)`, which makes the mesh part of jit's cache
  key: a function jitted and called outside the context is traced again inside
  it. The specs are read when the model is traced, so calling the same jitted
  function under the same mesh with other specs reuses the first trace.

  Args:
    mesh: the device mesh the params were placed on (`shard_params`).
    specs: the same float-weight specs given to `shard_params`.
    batch: the mesh axes the activation rows (the product's leading, non-
      contracted axes; the first of them) are split along (data parallel), or
      None (replicated).
  """
  token = _PLAN.set(MeshPlan(mesh, specs, batch))
  try:
    with jax.set_mesh(mesh):
      yield _PLAN.get()
  finally:
    _PLAN.reset(token)


def current_plan() -> MeshPlan | None:
  """The `shard_products` context in force, or None."""
  return _PLAN.get()


def current_param_path(operand: Any) -> str | None:
  """The '/'-joined path ('block_0/mlp/up/kernel') of the param `operand` is, in the Flax
  module Qwix is running now; None when it is not one of the module's params."""
  try:
    name = find_param(operand, WithAux)
  except ValueError:  # several params fit the shape heuristics
    return None
  if not name:
    return None
  module = current_module_path()
  return f"{module}/{name}" if module else name


def _leading_axis(axes: tuple[int, ...], shape: tuple[int, ...]) -> int:
  """The first of `axes` longer than 1 (the one a contiguous split of their flattening splits)."""
  return next((a for a in axes if shape[a] > 1), axes[0])


Split = tuple[AnyMesh, tuple[Any, ...], tuple[Any, ...]]
"""A product's split: the mesh, the float weight's spec entries, the activation rows' entries
(one per `layout.lhs_free` axis)."""


def _context_split(
  plan: MeshPlan | None, param_path: str | None, layout: ProductLayout
) -> Split | None:
  """The split `shard_products` gives the param at `param_path`, or None."""
  if plan is None or param_path is None:
    return None
  float_spec = SpecTable(plan.specs).lookup(param_path)
  if float_spec is None:
    return None
  entries = tuple(float_spec)
  extra = len(entries) - len(layout.weight.shape)
  if extra > 0:  # a param stacked by nn.scan: inside the scan the weight is one layer's slice
    if any(e is not None for e in entries[:extra]):
      raise ValueError(
        f"{param_path}: PartitionSpec {float_spec} splits the stacked layer axis; each scan"
        " step multiplies one layer, so the layer axis must stay whole (None)"
      )
    entries = entries[extra:]
  entries = spec_entries(P(*entries), len(layout.weight.shape), param_path)
  batch = (plan.batch,) + (None,) * (len(layout.lhs_free) - 1) if layout.lhs_free else ()
  return plan.mesh, entries, batch


def _typed_split(lhs: jax.Array, weight: Q8Array, layout: ProductLayout) -> Split | None:
  """The split in the Q8 values' type (a mesh with explicit axes), or None: K's and N's entries
  go on the leading axes of the float weight's contracted and free axes; the activation rows
  keep the split in the activation's type."""
  typed = type_spec(weight.q)
  if typed is None:
    return None
  wl = layout.weight
  k_entry, n_entry = spec_entries(typed, 2, "weight")
  entries: list[Any] = [None] * len(wl.shape)
  entries[_leading_axis(wl.contract, wl.shape)] = k_entry
  entries[_leading_axis(wl.free, wl.shape)] = n_entry
  batch: tuple[Any, ...] = (None,) * len(layout.lhs_free)
  lhs_typed = type_spec(lhs)
  if lhs_typed is not None:
    lhs_entries = spec_entries(lhs_typed, lhs.ndim, "activation")
    batch = tuple(lhs_entries[a] for a in layout.lhs_free)
  return jax.typeof(weight.q).sharding.mesh, tuple(entries), batch


def _lhs_entries(
  layout: ProductLayout, float_entries: tuple[Any, ...], batch: tuple[Any, ...], ndim: int
) -> list[Any]:
  """The activation's spec entries: rows by `batch`, contracted axes like the weight's."""
  entries: list[Any] = [None] * ndim
  for a, e in zip(layout.lhs_free, batch, strict=True):
    entries[a] = e
  for wa, la in zip(layout.weight.contract, layout.lhs_contract, strict=True):
    entries[la] = float_entries[wa]
  return entries


@dataclasses.dataclass(frozen=True)
class ProductPlan:
  """How one matched product runs per shard (`q8rules.sharding.product.run_sharded`)."""

  mesh: AnyMesh
  lhs_spec: P
  kn: P
  """The (K, N) matrix's spec (q and scale alike)."""
  out_spec: P
  local: ProductLayout
  """The product's layout on one device's shards."""


def plan_product(
  lhs: jax.Array, weight: Q8Array, layout: ProductLayout, operand: Any = None
) -> ProductPlan | None:
  """How a matched product splits: from the `shard_products` context (the float spec of the
  param `operand` is, through `layout.weight`), else from the weight's type when its mesh has
  explicit axes; None when nothing splits the weight.

  Activation rows split along mesh axes the weight does not use, and only when every
  activation axis divides evenly (else the activation rows stay whole)."""
  wl = layout.weight
  context = current_plan()
  param_path = current_param_path(operand) if context is not None else None
  split = _context_split(context, param_path, layout) or _typed_split(lhs, weight, layout)
  if split is None:
    return None
  mesh, float_entries, batch = split
  what = param_path or f"Q8 weight {wl.shape}"
  kn = q8_spec_for_layout(wl, P(*float_entries), what=what)
  if kn[0] is None and kn[1] is None:
    return None
  kn = check_q8_spec(tuple(weight.q.shape), kn, mesh, what=what)
  used = set(mesh_axes(kn[0])) | set(mesh_axes(kn[1]))
  batch = tuple(None if set(mesh_axes(e)) & used else e for e in batch)

  local_shape = list(wl.shape)
  for a, e in enumerate(float_entries):
    d = devices_along(mesh, e, what)
    if wl.shape[a] % d:
      raise ValueError(
        f"{what}: cannot split axis {a} of the float weight {wl.shape} over {d} devices ({e!r})"
      )
    local_shape[a] //= d
  local = dataclasses.replace(layout, weight=WeightLayout(tuple(local_shape), wl.contract, wl.free))
  lhs_entries = _lhs_entries(layout, float_entries, batch, lhs.ndim)
  divides = [
    size % devices_along(mesh, e, what) == 0 for size, e in zip(lhs.shape, lhs_entries, strict=True)
  ]
  if not all(divides):  # an activation axis does not split: keep the rows whole
    lhs_entries = _lhs_entries(layout, float_entries, (None,) * len(batch), lhs.ndim)
  pre = [lhs_entries[a] for a in layout.lhs_free] + [float_entries[a] for a in wl.free]
  out_spec = P(*(pre[i] for i in layout.out_perm))
  return ProductPlan(mesh, P(*lhs_entries), kn, out_spec, local)


def provider_product(
  lhs: jax.Array,
  weight: Q8Array,
  layout: ProductLayout,
  *,
  operand: Any = None,
  implementation: kernels.ImplementationArg = None,
  interpret: bool | None = None,
  act_qtype: str | None = None,
) -> tuple[jax.Array, str] | None:
  """The provider's hook: a matched product run per shard as `plan_product` splits it, or
  None to run it unsharded.

  Each device flattens its own slice of the activation to (m, K_local) (the
  activation view is per chip: nothing is gathered), runs its product, adds
  row-parallel partial sums in float32 (`ordered_sum`) and puts its (m, N_local) back
  into the op's output shape (`q8rules.sharding.product.run_sharded`).

  Args:
    lhs: the activation as the op got it (any rank).
    weight: the (K_padded, N) Q8Array.
    layout: the product's layout (`q8rules.layout.ProductLayout`).
    operand: the weight operand as the intercepted op got it (the param, or
      `WithAux`): its param path is looked up in `shard_products`'s specs.
    implementation, interpret, act_qtype: the rule's; None picks per shard.

  Returns:
    The op's output in lhs's dtype, split along the weight's N axes (on the
    output axis of the weight's split free axis), and the implementation the
    shards ran (chosen from the shard's shape); or None when nothing splits the
    weight (XLA's own partitioning, if any, applies then).
  """
  plan = plan_product(lhs, weight, layout, operand)
  if plan is None:
    return None
  return run_sharded(
    lhs,
    weight,
    plan.mesh,
    x_spec=plan.lhs_spec,
    w_spec=plan.kn,
    out_spec=plan.out_spec,
    to_matrix=plan.local.lhs_matrix,
    from_matrix=plan.local.output,
    implementation=implementation,
    interpret=interpret,
    act_qtype=act_qtype,
  )


def run_served(
  lhs: jax.Array,
  q8: WithAux,
  layout: ProductLayout,
  rule: Q8Rule | None,
  operand: Any,
  preferred_element_type: Any,
  where: str,
  group_sizes: jax.Array | None = None,
) -> tuple[jax.Array, str]:
  """`lhs` times the Q8 weight `q8` (laid out for this product as `layout`) as serving runs
  it: per shard where a mesh splits the weight (`provider_product`), else whole through
  `kernels.run_product` with the rule's `implementation` and `interpret`.

  Args:
    lhs: the activation as the op got it (any rank; float32, bfloat16 or float16).
    q8: the Q8 weight (a `Q8Weight` or Qwix `WithAux(Q8Array (K_padded, N), Q8How)`).
    layout: the product's layout, conformed to the weight's (`Q8Provider._served_weight`).
    rule: the matched rule (None: the defaults).
    operand: the op's own weight operand (how a mesh plan finds its param).
    preferred_element_type: the op's own.
    where: how errors name the op ('module/path/op_id').

  Returns:
    (y in the op's output shape, accumulated in float32: in lhs's dtype when split over a mesh,
    else in `preferred_element_type` or lhs's; the caller casts it to the op's dtype; the path
    it took).
  """
  weight = q8.array
  options = {
    "implementation": rule.implementation if rule is not None else None,
    "interpret": rule.interpret if rule is not None else None,
    "act_qtype": rule.act_qtype if rule is not None else None,
  }
  if group_sizes is not None or layout.batched:
    return _run_grouped(lhs, q8.array, layout, options, group_sizes, preferred_element_type, where)
  try:
    layout.check_lhs(tuple(lhs.shape))
    # split over a mesh (`q8rules.shard_products`, or explicit sharding): per shard, on the
    # layer's own arrays (a `LayerSlice` is read in place only unsplit; unused, XLA drops
    # the slice)
    whole = weight.take() if isinstance(weight, LayerSlice) else weight
    ran = provider_product(lhs, whole, layout, operand=operand, **options)
    if ran is None:
      y2d, path = kernels.run_product(
        layout.lhs_matrix(lhs), weight, preferred_element_type=preferred_element_type, **options
      )
      ran = layout.output(y2d, tuple(lhs.shape)), path
  except (TypeError, ValueError, NotImplementedError) as e:
    raise type(e)(f"{where}: {e}") from e
  return ran


def _run_grouped(
  lhs: jax.Array,
  weight: Q8Array,
  layout: ProductLayout,
  options: dict[str, Any],
  group_sizes: jax.Array | None,
  preferred_element_type: Any,
  where: str,
) -> tuple[jax.Array, str]:
  """A product on a stack of Q8_0 experts, weight (*E, K_padded, N) blocked along each expert's
  K, through op 'ragged_matmul' (each expert read once for all its rows); XLA partitions it on a
  mesh. Grouped (`jax.lax.ragged_dot`, `group_sizes` given): lhs (M, K) rows sorted by group.
  Batched (`layout.batched`, an einsum over the expert axis): each expert's M rows of the
  activation (`layout.lhs_matrix`, (E, M, K_padded)) are its group, all groups of M rows. The
  rule's `implementation` applies where the op has one of that name, and its `act_qtype` (Q8_0
  activations, as llama.cpp multiplies its experts)."""
  names = options["implementation"]
  names = (names,) if isinstance(names, str) else tuple(names or ())
  served = tuple(n for n in names if n in kernels.RAGGED_IMPLEMENTATIONS)
  try:
    layout.check_lhs(tuple(lhs.shape))
    run = functools.partial(
      kernels.run_ragged,
      implementation=served or None,
      interpret=options["interpret"],
      preferred_element_type=preferred_element_type,
      act_qtype=options["act_qtype"],
    )
    if group_sizes is not None:
      return run(lhs, weight, group_sizes)
    stack = weight.take() if isinstance(weight, LayerSlice) else weight
    k_pad, n = stack.shape[-2:]
    experts = math.prod(stack.shape[:-2])
    stack = dataclasses.replace(
      stack,
      q=stack.q.reshape(experts, k_pad, n),
      scale=stack.scale.reshape(experts, k_pad // BLOCK, n),
      axis=1,
    )
    x3 = layout.lhs_matrix(lhs)  # (E, M, K_padded)
    m = x3.shape[1]
    y, path = run(x3.reshape(experts * m, k_pad), stack, jnp.full((experts,), m, jnp.int32))
    return layout.output(y.reshape(experts, m, n), tuple(lhs.shape)), path
  except (TypeError, ValueError, NotImplementedError) as e:
    raise type(e)(f"{where}: {e}") from e


__all__ = [
  "MeshPlan",
  "ProductPlan",
  "current_param_path",
  "current_plan",
  "plan_product",
  "provider_product",
  "run_served",
  "shard_products",
]
