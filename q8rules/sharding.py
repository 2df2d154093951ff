"""Tensor-parallel Q8_0 on a device mesh, with JAX's own SPMD machinery.

A Q8_0 weight is the pair `q` int8 (K, N) and `scale` (K/32, N), blocked along
K. A `PartitionSpec` on the (K, N) matrix applies to both parts unchanged:

  * column-parallel, `P(None, 'tp')`: each device holds its columns of `q`
    and their scales, (K, N/d) and (K/32, N/d); its product reads only those;
    the outputs are the columns of y, sharded along N (no communication).
  * row-parallel, `P('tp', None)`: each device holds whole 32-row blocks,
    (K/d, N) and (K/32/d, N), and the matching slice of x's K axis; the
    float32 partial sums are added over 'tp' (`jax.lax.psum`, one
    all-reduce) and then cast to x's dtype. A split that cuts a 32-row block
    (K=96 over 2 devices: 48 rows each) is refused.

`q8_matmul_sharded` runs `q8_matmul`'s implementations per shard inside
`shard_map`: the Pallas fold is a custom call XLA cannot partition, so each
device calls it on what lives on that device, and the fold pads that
device's columns to its column tile (40 columns per device become one tile of
128, with zero values and zero scales, sliced off after). A replicated
activation is not gathered per op: under `shard_map` with `x` at `P()` every
device already holds the whole of it and builds its own view (blocked rows,
padded to the tile) for its folds.

Through Qwix/Flax: `shard_params(q8_params, mesh, specs)` places a Q8 param
tree (from `Q8Provider` + `quantize_params`) with `NamedSharding`s, given the
PartitionSpec each *float* weight would have had; a Q8 weight's spec goes
through its `Q8How.layout` (the float weight's contraction axes become K, the
others N). A quantized model under `jax.jit` then runs sharded:

  * with XLA's automatic partitioning (the default `AxisType.Auto` mesh) the
    chunked XLA product is partitioned by XLA itself; `use_mesh(mesh, specs)`
    makes the provider run each matched product per shard in `shard_map`
    instead (needed for the fold, and to keep row-parallel products an
    all-reduce of partial sums);
  * with explicit sharding (`AxisType.Explicit`, the default of
    `jax.make_mesh` in jax 0.10), a weight's spec is in its type and the
    provider reads it there (no context needed).

(Both through `provider_product`, which `Q8Provider` calls for each Q8 product.)

Limits:
  * a model that calls `shard_map` itself around a weight (a linen module
    passing its kernel param into `jax.shard_map`) does not get that weight
    quantized: inside the map Qwix sees a per-device tracer of another shape,
    which `find_param` cannot trace back to the param, so the op is recorded
    as 'float' ("operand is not a weight") and the param stays float. (A
    linen submodule called inside `jax.shard_map` leaks tracers even
    unquantized: linen has no lifted shard_map.) Write the model without
    its own `shard_map` and let `shard_params` + `use_mesh` split it.
  * a K split must fall on whole 32-row blocks of the unpadded K; a float
    axis split must be the leading (longer than 1) axis of those flattened
    into K (or N), so that each device's part is a contiguous range.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules import kernels
from q8rules.layout import ProductLayout, WeightLayout
from q8rules.q8_0 import BLOCK, Q8Array

try:  # jax >= 0.6.1 (0.10, 0.11): `jax.shard_map`, `check_vma`
  from jax import shard_map as _shard_map_fn

  _CHECK_KWARG = "check_vma"
except ImportError:  # older jax: the experimental module, `check_rep`
  from jax.experimental.shard_map import shard_map as _shard_map_fn  # type: ignore[no-redef]

  _CHECK_KWARG = "check_rep"

_set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # jax >= 0.7 / older

AnyMesh = Mesh | AbstractMesh
SpecKey = str | tuple[Any, ...]
"""A key of `specs`: a '/'-joined param path, a regex on it (`re.fullmatch`), or a path tuple."""


def shard_map(
  f: Callable[..., Any], mesh: AnyMesh, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
  """`jax.shard_map` (or `jax.experimental.shard_map.shard_map` on older jax) without the
  replication check (the Pallas fold's output carries no varying-axes type)."""
  return _shard_map_fn(
    f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_KWARG: False}
  )


# ---- specs ---------------------------------------------------------------------


def _axes(entry: Any) -> tuple[str, ...]:
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


def _entries(spec: Any, ndim: int, what: str) -> tuple[Any, ...]:
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


def _devices(mesh: AnyMesh, entry: Any, what: str) -> int:
  """How many pieces `entry` splits an axis into on `mesh`; an error for unknown axes."""
  shape = _mesh_shape(mesh)
  axes = _axes(entry)
  for a in axes:
    if a not in shape:
      raise ValueError(f"{what}: mesh axis {a!r} is not in the mesh (axes {tuple(shape)})")
  return math.prod(shape[a] for a in axes)


def _check_spec_axes(entries: tuple[Any, ...], what: str) -> None:
  seen: list[str] = []
  for e in entries:
    for a in _axes(e):
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
  entries = _entries(spec, len(shape), what)
  _check_spec_axes(entries, what)
  *lead, k, n = shape
  for i, (size, e) in enumerate(zip(lead, entries[:-2], strict=True)):
    d = _devices(mesh, e, what)
    if size % d:
      raise ValueError(
        f"{what}: cannot split leading axis {i} of size {size} over {d} devices ({e!r})"
      )
  dk = _devices(mesh, entries[-2], what)
  dn = _devices(mesh, entries[-1], what)
  if k % (BLOCK * dk):
    raise ValueError(
      f"{what}: cannot split K={k} rows of a Q8_0 weight of shape {tuple(shape)} over"
      f" {dk} devices (mesh axes {_axes(entries[-2])}): {k / dk:g} rows per device"
      f" {'cuts a' if k % dk == 0 else 'is not a whole number of'} {BLOCK}-row block"
      f"{'' if k % dk == 0 else 's'}; K must be a multiple of {BLOCK * dk}"
      f" ({k // BLOCK} blocks do not divide by {dk})"
    )
  if n % dn:
    raise ValueError(
      f"{what}: cannot split N={n} columns of a Q8_0 weight of shape {tuple(shape)} over"
      f" {dn} devices (mesh axes {_axes(entries[-1])}): N must be a multiple of {dn}"
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
  weight `P(None, 'tp', None)` -> `(D, heads*H)` `P(None, 'tp')`.
  """
  entries = _entries(spec, len(layout.shape), f"{what} {layout.shape}")
  _check_spec_axes(entries, f"{what} {layout.shape}")

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
  return P(k_entry, group(layout.free, "N"))


# ---- the product ---------------------------------------------------------------


def _local_product(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  implementation: str | None,
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


def _type_spec(a: Any) -> P | None:
  """The spec in `a`'s type when its mesh has explicit axes (sharding in types), else None."""
  try:
    sharding = jax.typeof(a).sharding
  except (AttributeError, TypeError):
    return None
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not getattr(mesh, "explicit_axes", ()):
    return None
  return sharding.spec


def _place(a: jax.Array, mesh: AnyMesh, spec: P) -> jax.Array:
  """`a` laid out by `spec` on `mesh`: a device_put (a sharding constraint under jit)."""
  if isinstance(mesh, Mesh):
    return jax.device_put(a, NamedSharding(mesh, spec))
  current = _type_spec(a)
  if current is not None and _entries(current, a.ndim, "x") == _entries(spec, a.ndim, "x"):
    return a
  return jax.sharding.reshard(a, NamedSharding(mesh, spec))


def q8_matmul_sharded(
  x: jax.Array,
  w: Q8Array,
  mesh: AnyMesh,
  *,
  w_spec: Any,
  x_spec: Any = None,
  implementation: kernels.Implementation = None,
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
  if implementation not in (None, *kernels.IMPLEMENTATIONS):
    raise ValueError(
      f"implementation must be one of {kernels.IMPLEMENTATIONS} or None, got {implementation!r}"
    )
  w_spec = check_q8_spec(w.shape, w_spec, mesh, what=f"q8_matmul_sharded: weight {w.shape}")
  k_entry, n_entry = tuple(w_spec)
  xs = _entries(x_spec, x.ndim, f"q8_matmul_sharded: x {tuple(x.shape)}")
  if x_spec is None:
    xs = xs[:-1] + (k_entry,)
  if _axes(xs[-1]) != _axes(k_entry):
    raise ValueError(
      f"q8_matmul_sharded: x_spec {P(*xs)} splits x's K axis over {_axes(xs[-1])} but the"
      f" weight's K is split over {_axes(k_entry)} (w_spec {w_spec}); they must match"
    )
  out_entries = xs[:-1] + (n_entry,)
  _check_spec_axes(out_entries, f"q8_matmul_sharded: output spec {P(*out_entries)}")
  for size, e in zip(x.shape[:-1], xs[:-1], strict=True):
    d = _devices(mesh, e, "q8_matmul_sharded: x_spec")
    if size % d:
      raise ValueError(
        f"q8_matmul_sharded: x of shape {tuple(x.shape)}: an axis of size {size} does not"
        f" split over {d} devices ({e!r})"
      )
  x_spec, out_spec = P(*xs), P(*out_entries)
  k_axes = _axes(k_entry)
  n = w.shape[1]

  def per_shard(x_local: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    lead = x_local.shape[:-1]
    y = _local_product(x_local.reshape(-1, q.shape[0]), q, scale, implementation, interpret)
    if k_axes:  # row-parallel: float32 partial sums, added before the cast
      y = jax.lax.psum(y, k_axes)
    return y.astype(x_local.dtype).reshape(*lead, q.shape[1])

  x = _place(x, mesh, x_spec)
  q = _place(w.q, mesh, w_spec)
  scale = _place(w.scale, mesh, w_spec)
  f = shard_map(per_shard, mesh, in_specs=(x_spec, w_spec, w_spec), out_specs=out_spec)
  y = f(x, q, scale)
  assert y.shape == (*x.shape[:-1], n), (y.shape, x.shape, n)
  return y


# ---- param trees ---------------------------------------------------------------


def _key_str(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(path: tuple[Any, ...]) -> str:
  """A pytree path (jax keys or plain names) as 'a/b/c'."""
  return "/".join(_key_str(k) for k in path)


@dataclasses.dataclass
class _SpecTable:
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


def _is_q8_param(x: Any) -> bool:
  from q8rules.providers.serving import Q8How, WithAux

  return isinstance(x, WithAux) and isinstance(x.how, Q8How) and isinstance(x.array, Q8Array)


def _q8_param_spec(param: Any, spec: Any, mesh: AnyMesh, name: str) -> P:
  """The (…, K, N) spec of a Q8 param `WithAux(Q8Array, Q8How)` given its float weight's spec.

  Weights stacked by `nn.scan`/`nn.vmap` carry leading layer axes on both the
  float weight and the Q8Array; their spec entries carry over unchanged.
  """
  layout = param.how.layout
  q_shape = tuple(param.array.q.shape)
  lead = len(q_shape) - 2
  entries = _entries(spec, lead + len(layout.shape), f"{name} (float shape {layout.shape})")
  kn = q8_spec_for_layout(layout, P(*entries[lead:]), what=name)
  return check_q8_spec(q_shape, P(*entries[:lead], *kn), mesh, what=name)


def _float_param_spec(leaf: Any, spec: Any, mesh: AnyMesh, name: str) -> P:
  """The spec of a param that is not Q8 (a bias, a float weight), validated."""
  shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
  entries = _entries(spec, len(shape), f"{name} of shape {shape}")
  _check_spec_axes(entries, name)
  for size, e in zip(shape, entries, strict=True):
    d = _devices(mesh, e, name)
    if size % d:
      raise ValueError(
        f"{name}: cannot split an axis of size {size} of shape {shape} over {d} devices ({e!r})"
      )
  return P(*entries)


def _nnx_q8_params(module: Any) -> dict[tuple[str, ...], Any]:
  """Paths (attribute names) of the `WithAux(Q8Array, Q8How)` nodes of an nnx module."""
  from flax import nnx

  found: dict[tuple[str, ...], Any] = {}
  for path, node in nnx.iter_graph(module):
    if _is_q8_param(node):
      found[tuple(str(p) for p in path)] = node
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
      no key matches are replicated.
    strict: raise when a key of `specs` matches no param (a typo).

  Returns:
    A tree of the same structure as `params` with a `NamedSharding` per leaf
    (for `jax.device_put`, or `jax.jit(..., out_shardings=...)` to quantize
    straight onto the mesh).
  """
  table = _SpecTable(specs)

  def one(path: tuple[Any, ...], leaf: Any) -> Any:
    name = path_str(path)
    spec = table.lookup(name)
    if _is_q8_param(leaf):
      q_spec = _q8_param_spec(leaf, spec, mesh, name)
      s = NamedSharding(mesh, q_spec)
      return leaf.replace(array=dataclasses.replace(leaf.array, q=s, scale=s))
    return NamedSharding(mesh, _float_param_spec(leaf, spec, mesh, name))

  out = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_q8_param)
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
    from flax import nnx

    is_nnx = isinstance(params, nnx.Module)
  except ImportError:  # pragma: no cover
    is_nnx = False
  if not is_nnx:
    return jax.device_put(params, param_shardings(params, mesh, specs, strict=strict))

  q8 = _nnx_q8_params(params)
  pure = nnx.to_pure_dict(nnx.state(params, nnx.Param))
  table = _SpecTable(specs)

  def one(path: tuple[Any, ...], leaf: Any) -> Any:
    keys = tuple(_key_str(k) for k in path)
    if len(keys) > 2 and keys[-2] == "array" and keys[:-2] in q8:
      name = "/".join(keys[:-2])
      spec = _q8_param_spec(q8[keys[:-2]], table.lookup(name), mesh, name)
    else:
      name = "/".join(keys)
      spec = _float_param_spec(leaf, table.lookup(name), mesh, name)
    return jax.device_put(leaf, NamedSharding(mesh, spec))

  placed = jax.tree_util.tree_map_with_path(one, pure)
  if strict:
    table.check_all_used()
  nnx.update(params, placed)
  return params


# ---- the provider's mesh context --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """What `use_mesh` sets: the mesh, the float-weight specs, the activation rows' split."""

  mesh: Mesh
  specs: Mapping[SpecKey, Any]
  batch: Any = None


_PLAN: contextvars.ContextVar[MeshPlan | None] = contextvars.ContextVar(
  "q8_mesh_plan", default=None
)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, specs: Mapping[SpecKey, Any], *, batch: Any = None) -> Iterator[MeshPlan]:
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
    with _set_mesh(mesh):
      yield _PLAN.get()
  finally:
    _PLAN.reset(token)


def current_plan() -> MeshPlan | None:
  """The `use_mesh` context in force, or None."""
  return _PLAN.get()


def current_param_path(operand: Any) -> str | None:
  """The '/'-joined path ('block_0/mlp/up/kernel') of the param `operand` is, in the Flax
  module Qwix is running now; None when it is not one of the module's params."""
  from qwix._src.utils import flax_util

  from q8rules.providers.serving import WithAux

  try:
    name = flax_util.find_param(operand, WithAux)
  except ValueError:  # several params fit the shape heuristics
    return None
  if not name:
    return None
  module = "/".join(map(str, flax_util.get_current_module_path()))
  return f"{module}/{name}" if module else name


def _leading_axis(axes: tuple[int, ...], shape: tuple[int, ...]) -> int:
  """The first of `axes` longer than 1 (the one a contiguous split of their flattening splits)."""
  return next((a for a in axes if shape[a] > 1), axes[0])


def provider_product(
  lhs: jax.Array,
  weight: Q8Array,
  layout: ProductLayout,
  *,
  operand: Any = None,
  implementation: kernels.Implementation = None,
  interpret: bool | None = None,
) -> jax.Array | None:
  """The provider's hook: a matched product run per shard, or None to run it unsharded.

  The weight's split comes from the `use_mesh` context (the float spec of the
  param `operand` is, through `layout.weight`), else from the weight's type
  when its mesh has explicit axes. Each device flattens its own slice of the
  activation to (m, K_local) (the activation view is per chip: nothing is
  gathered), runs its product, adds row-parallel partial sums in float32
  (`psum`) and puts its (m, N_local) back into the op's output shape.

  Args:
    lhs: the activation as the op got it (any rank).
    weight: the (K_padded, N) Q8Array.
    layout: the product's layout (`q8rules.layout.ProductLayout`).
    operand: the weight operand as the intercepted op got it (the param, or
      `WithAux`): its param path is looked up in `use_mesh`'s specs.
    implementation, interpret: the rule's; None picks per shard.

  Returns:
    The op's output in lhs's dtype, split along the weight's N axes (on the
    output axis of the weight's split free axis), or None when nothing splits
    the weight (XLA's own partitioning, if any, applies then).
  """
  wl = layout.weight
  plan = current_plan()
  mesh: AnyMesh | None = None
  float_entries: tuple[Any, ...] | None = None
  batch: tuple[Any, ...] = (None,) * len(layout.lhs_free)
  param_path = current_param_path(operand) if plan is not None else None
  if plan is not None and param_path is not None:
    float_spec = _SpecTable(plan.specs).lookup(param_path)
    if float_spec is not None:
      mesh = plan.mesh
      float_entries = _entries(float_spec, len(wl.shape), param_path)
      if layout.lhs_free:
        batch = (plan.batch,) + batch[1:]
  if float_entries is None:
    typed = _type_spec(weight.q)
    if typed is None:
      return None
    mesh = jax.typeof(weight.q).sharding.mesh
    k_entry, n_entry = _entries(typed, 2, "weight")
    entries = [None] * len(wl.shape)
    entries[_leading_axis(wl.contract, wl.shape)] = k_entry
    entries[_leading_axis(wl.free, wl.shape)] = n_entry
    float_entries = tuple(entries)
    lhs_typed = _type_spec(lhs)
    if lhs_typed is not None:
      lhs_entries = _entries(lhs_typed, lhs.ndim, "activation")
      batch = tuple(lhs_entries[a] for a in layout.lhs_free)
  assert mesh is not None
  what = param_path or f"Q8 weight {wl.shape}"
  kn = q8_spec_for_layout(wl, P(*float_entries), what=what)
  if kn[0] is None and kn[1] is None:
    return None
  kn = check_q8_spec(tuple(weight.q.shape), kn, mesh, what=what)
  used = set(_axes(kn[0])) | set(_axes(kn[1]))
  batch = tuple(None if set(_axes(e)) & used else e for e in batch)

  local_shape = list(wl.shape)
  for a, e in enumerate(float_entries):
    d = _devices(mesh, e, what)
    if wl.shape[a] % d:
      raise ValueError(
        f"{what}: cannot split axis {a} of the float weight {wl.shape} over {d} devices ({e!r})"
      )
    local_shape[a] //= d
  local = dataclasses.replace(layout, weight=WeightLayout(tuple(local_shape), wl.contract, wl.free))
  lhs_entries = [None] * lhs.ndim
  for a, e in zip(layout.lhs_free, batch, strict=True):
    lhs_entries[a] = e
  for wa, la in zip(wl.contract, layout.lhs_contract, strict=True):
    lhs_entries[la] = float_entries[wa]
  for size, e in zip(lhs.shape, lhs_entries, strict=True):
    if size % _devices(mesh, e, what):
      batch = ()  # an activation axis does not split: keep it whole
  if not batch:
    lhs_entries = [None] * lhs.ndim
    for wa, la in zip(wl.contract, layout.lhs_contract, strict=True):
      lhs_entries[la] = float_entries[wa]
  pre = [lhs_entries[a] for a in layout.lhs_free] + [float_entries[a] for a in wl.free]
  out_spec = P(*(pre[i] for i in layout.out_perm))
  lhs_spec = P(*lhs_entries)
  k_axes = _axes(kn[0])

  def per_shard(lhs_local: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    x2d = local.lhs_matrix(lhs_local)
    y2d = _local_product(x2d, q, scale, implementation, interpret)
    if k_axes:  # row-parallel: float32 partial sums, added before the cast
      y2d = jax.lax.psum(y2d, k_axes)
    return local.output(y2d.astype(lhs_local.dtype), tuple(lhs_local.shape))

  f = shard_map(per_shard, mesh, in_specs=(lhs_spec, kn, kn), out_specs=out_spec)
  return f(_place(lhs, mesh, lhs_spec), _place(weight.q, mesh, kn), _place(weight.scale, mesh, kn))


__all__ = [
  "MeshPlan",
  "check_q8_spec",
  "current_param_path",
  "current_plan",
  "param_shardings",
  "path_str",
  "provider_product",
  "q8_matmul_sharded",
  "q8_sharding",
  "q8_spec_for_layout",
  "shard_map",
  "shard_params",
  "shard_q8",
  "use_mesh",
]
