"""`Q8LoraProvider` on a 4-device mesh: the adapters follow their Q8_0 base's split.

The block of tests/_lora_models.py: `up` column-parallel (N split: B (r, N) split along N, A
whole), `down` row-parallel (K split: A (K, r) split along K, B whole). The adapters get these
shardings from `q8rules.shard_params` (linen and nnx), from the float params' annotations
(linen `nn.with_partitioning`, nnx eager sharding under `jax.set_mesh`), and as stacked layers
(`nn.scan`). Outputs and the gradients of A, B and x are checked against a float64 pass through
the dequantised weights, on meshes with Auto and Explicit axes, with and without
`q8rules.shard_products`.
"""

from __future__ import annotations

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import q8rules
from q8rules import sharding
from q8rules.lora.placement import place_like_base
from q8rules.q8_0 import quantize
from tests import _lora_models as lm
from tests._utils import rel_err

DEVICES = 4
OUT_TOL, GRAD_TOL = 1e-6, 1e-5
"""Relative (L2) error allowed against float64: outputs, gradients (float32 throughout)."""

SPECS = {"up/kernel": P(None, "tp"), "down/kernel": P("tp", None, None)}
"""The float weights' specs: `up` (D, F) column-parallel, `down` (F, H, KH) row-parallel."""

ADAPTER_SPECS = {
  ("up", "a"): P(None, None),
  ("up", "b"): P(None, "tp"),
  ("down", "a"): P("tp", None),
  ("down", "b"): P(None, None),
}
"""What the adapters' shardings must be: A (K, r) takes the base's K split, B (r, N) its N's."""

AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


def mesh_of(axis_type: AxisType) -> jax.sharding.Mesh:
  """A 1-D 'tp' mesh over the first DEVICES devices (skips the test when there are fewer)."""
  devices = jax.devices()
  if len(devices) < DEVICES:
    pytest.skip(f"needs {DEVICES} devices; the {jax.default_backend()} backend has {len(devices)}")
  return jax.make_mesh((DEVICES,), ("tp",), axis_types=(axis_type,), devices=devices[:DEVICES])


def padded(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def check_spec(a, want: P, what: str) -> None:
  """`a` is laid out by `want` (a placed array's sharding)."""
  got = a.sharding.spec
  assert padded(got, a.ndim) == padded(want, a.ndim), f"{what}: {got}, want {want}"


def reference(kernels: dict, adapters: dict, x, c, lead: int | None = None):
  """float64 (out, per-layer name -> (dA, dB), dx): `kernels` name -> Q8 param, `adapters`
  name -> (A, B); `lead` stacked layers, or None for one block."""
  w = {name: lm.matrix64(kernels[name]) for name in lm.NAMES}
  ab = {name: tuple(np.asarray(t) for t in adapters[name]) for name in lm.NAMES}
  if lead is None:
    layers = [{name: (w[name], *ab[name]) for name in lm.NAMES}]
  else:
    layers = [{n: (w[n][i], ab[n][0][i], ab[n][1][i]) for n in lm.NAMES} for i in range(lead)]
  return lm.forward_backward64(np.asarray(x), layers, np.asarray(c))


def collectives(hlo: str) -> list[tuple[str, str]]:
  """(kind, 'dtype[shape]') of every collective a compiled program runs."""
  kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
  return [
    (kind, result)
    for result, kind in re.findall(rf"= (\w+\[[\d,]*\])\S* ({kinds})(?:-start)?\(", hlo)
  ]


def check_numbers(out, grads: dict, dx, ref) -> None:
  """Output, name -> (dA, dB) (stacked when the reference has several layers) and dx against
  `reference`'s."""
  ref_out, ref_layers, ref_dx = ref
  err = rel_err(out, ref_out)
  assert err < OUT_TOL, f"output: {err:.2e}"
  for name in lm.NAMES:
    for j, which in enumerate("AB"):
      want = np.stack([layer[name][j] for layer in ref_layers])
      got = np.asarray(grads[name][j]).reshape(want.shape)
      err = rel_err(got, want)
      assert err < GRAD_TOL, f"d{which} of {name}: {err:.2e}"
  err = rel_err(dx, ref_dx)
  assert err < GRAD_TOL, f"dx: {err:.2e}"


# ---- linen: shard_params -----------------------------------------------------------


@pytest.fixture(scope="module")
def linen_lora():
  """The LoRA block (linen), its Q8 params with random adapters, x, the cotangent and the
  float64 reference (the tests read them, never change them)."""
  rng = np.random.default_rng(31)
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  model = qwix.quantize_model(lm.Block(), q8rules.Q8LoraProvider(lm.rules()))
  params = jax.jit(model.init)(lm.key_of(rng), x)["params"]
  adapters = lm.random_adapters(rng)
  for name in lm.NAMES:
    a, b = adapters[name]
    params[name] = {**params[name], "kernel_lora_a": a, "kernel_lora_b": b}
  kernels = {name: params[name]["kernel"] for name in lm.NAMES}
  return model, params, x, c, reference(kernels, adapters, x, c)


def split(params: dict) -> tuple[dict, dict]:
  """(the Q8 kernels, the adapters) of the block's linen params."""
  base = {n: {"kernel": params[n]["kernel"]} for n in lm.NAMES}
  lora = {n: {k: v for k, v in params[n].items() if k != "kernel"} for n in lm.NAMES}
  return base, lora


def linen_apply(model, base: dict):
  """`apply(lora, x)`: the linen block's output on the Q8 kernels `base` and adapters `lora`."""

  def apply(lora, x):
    return model.apply({"params": {n: {**base[n], **lora[n]} for n in lm.NAMES}}, x)[0]

  return apply


def linen_run(model, base: dict, lora: dict, x, c):
  """Output, adapter grads (name -> (dA, dB)) and dx of the linen block under jit."""
  apply = linen_apply(model, base)

  def loss(lora, x):
    out = apply(lora, x)
    return jnp.sum(out * c), out

  (g, dx), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(lora, x)
  grads = {n: (g[n]["kernel_lora_a"], g[n]["kernel_lora_b"]) for n in lm.NAMES}
  return out, grads, dx


@pytest.mark.parametrize("products", [False, True], ids=["xla", "shard_products"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_linen_shard_params(linen_lora, axis_type, products):
  """`shard_params` with the kernels' specs only: A and B follow their base; output and grads
  against float64; each adapter's gradient is laid out as the adapter is; under
  `shard_products` the forward pass moves only partial sums (no weight, adapter or activation
  is gathered)."""
  model, params, x, c, ref = linen_lora
  mesh = mesh_of(axis_type)
  placed = sharding.shard_params(params, mesh, SPECS)
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(placed[name][f"kernel_lora_{which}"], want, f"{name} {which.upper()}")
  base, lora = split(placed)
  ctx = q8rules.shard_products(mesh, SPECS) if products else contextlib.nullcontext()
  with ctx:
    out, grads, dx = linen_run(model, base, lora, x, c)
    hlo = jax.jit(linen_apply(model, base)).lower(lora, x).compile().as_text()
  check_numbers(out, grads, dx, ref)
  if products:  # what moves: down's x @ A partial sums (6 rows, rank 4) and its base's
    rows = 6
    assert sorted(collectives(hlo)) == [
      ("all-gather", f"f32[{DEVICES},{rows},{lm.D}]"),
      ("all-reduce", f"f32[{rows},{lm.RANK}]"),
    ], collectives(hlo)
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(grads[name]["ab".index(which)], want, f"d{which.upper()} of {name}")


def test_a_spec_naming_an_adapter_wins(linen_lora):
  """A key of `specs` naming an adapter overrides the base's; an unnamed one follows it."""
  _, params, *_ = linen_lora
  mesh = mesh_of(AxisType.Auto)
  placed = sharding.shard_params(params, mesh, {**SPECS, "up/kernel_lora_b": P()})
  check_spec(placed["up"]["kernel_lora_b"], P(), "up B, named")
  check_spec(placed["down"]["kernel_lora_a"], P("tp", None), "down A, derived")


# ---- linen: annotations ------------------------------------------------------------


@pytest.mark.slow
def test_linen_partitioning_annotates_and_places_the_adapters(rng):
  """`nn.with_partitioning` on the float kernels: the init's adapter boxes carry the base's
  split (nn.get_partition_spec), so `jit(init, out_shardings=nn.get_sharding(...))` puts them
  on the mesh split as their base; grads against float64."""
  mesh = mesh_of(AxisType.Auto)
  init = nn.initializers.lecun_normal()
  block = lm.Block(
    up_init=nn.with_partitioning(init, (None, "tp")),
    down_init=nn.with_partitioning(init, ("tp", None, None)),
  )
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  model = qwix.quantize_model(block, q8rules.Q8LoraProvider(lm.rules()))
  key = lm.key_of(rng)
  abstract = jax.eval_shape(model.init, key, x)
  names = nn.get_partition_spec(abstract)["params"]
  for (name, which), want in ADAPTER_SPECS.items():
    got = names[name][f"kernel_lora_{which}"]
    assert padded(got, 2) == padded(want, 2), (name, which, got)
  with jax.set_mesh(mesh):
    variables = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(key, x)
  params = nn.unbox(variables)["params"]
  adapters = lm.random_adapters(rng)
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(params[name][f"kernel_lora_{which}"], want, f"{name} {which.upper()}")
    j = "ab".index(which)
    params[name][f"kernel_lora_{which}"] = jax.device_put(
      adapters[name][j], NamedSharding(mesh, want)
    )
  kernels = {name: params[name]["kernel"] for name in lm.NAMES}
  out, grads, dx = linen_run(model, *split(params), x, c)
  check_numbers(out, grads, dx, reference(kernels, adapters, x, c))
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(grads[name]["ab".index(which)], want, f"d{which.upper()} of {name}")


# ---- nnx ---------------------------------------------------------------------------


def nnx_run(model, x, c):
  """Output, adapter grads (name -> (dA, dB)) and dx of the nnx block under nnx.jit."""

  def loss(m, x):
    out = m(x)
    return jnp.sum(out * c), out

  diff = nnx.DiffState(0, nnx.LoRAParam)
  (g, dx), out = nnx.jit(nnx.grad(loss, argnums=(diff, 1), has_aux=True))(model, x)
  grads = {n: (g[n]["kernel_lora_a"][...], g[n]["kernel_lora_b"][...]) for n in lm.NAMES}
  return out, grads, dx


def set_adapters(model, adapters: dict) -> None:
  """Give the nnx block's adapters these values, laid out as the adapters they replace."""
  for name in lm.NAMES:
    layer = getattr(model, name)
    for which, value in zip("ab", adapters[name], strict=True):
      var = getattr(layer, f"kernel_lora_{which}")
      var.value = jax.device_put(value, var[...].sharding)


def nnx_kernels(model) -> dict:
  return {name: getattr(model, name).kernel for name in lm.NAMES}


def annotated_block(seed: int) -> lm.NBlock:
  """The nnx block with its kernels annotated column- (up) and row-parallel (down) on 'tp'
  (made under `jax.set_mesh`: eager sharding places them)."""
  init = nnx.initializers.lecun_normal()
  return lm.NBlock(
    nnx.Rngs(seed),
    up_init=nnx.with_partitioning(init, (None, "tp")),
    down_init=nnx.with_partitioning(init, ("tp", None, None)),
  )


@pytest.mark.slow
def test_nnx_eager_sharding_annotates_and_places_the_adapters(rng):
  """A float model made under `jax.set_mesh` with annotated kernels (eager sharding):
  `apply_lora_to_model` gives each adapter the base's split in its metadata and its placement;
  output and nnx.grad of A, B and x against float64, each gradient laid out as its adapter."""
  mesh = mesh_of(AxisType.Auto)
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  seed = int(rng.integers(2**31))
  with jax.set_mesh(mesh):
    block = annotated_block(seed)
    provider = q8rules.Q8LoraProvider(lm.rules())
    model = qwix.apply_lora_to_model(block, provider, x, rngs=nnx.Rngs(seed + 1))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.LoRAParam)))
    for (name, which), want in ADAPTER_SPECS.items():
      var = getattr(getattr(model, name), f"kernel_lora_{which}")
      check_spec(var[...], want, f"{name} {which.upper()}")
      got = specs[name][f"kernel_lora_{which}"]
      assert padded(got, 2) == padded(want, 2), (name, which, got)
    adapters = lm.random_adapters(rng)
    set_adapters(model, adapters)
    out, grads, dx = nnx_run(model, x, c)
  check_numbers(out, grads, dx, reference(nnx_kernels(model), adapters, x, c))
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(grads[name]["ab".index(which)], want, f"d{which.upper()} of {name}")


@pytest.mark.slow
def test_nnx_adapters_made_outside_the_mesh_follow_the_placed_base(rng):
  """The float model made under `jax.set_mesh` (eager sharding), LoRA applied after, outside
  it: each adapter is put where its base's Q8 values are, split as above, and annotated so (its
  eager sharding off: there is no mesh in context to resolve it)."""
  mesh = mesh_of(AxisType.Auto)
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  seed = int(rng.integers(2**31))
  with jax.set_mesh(mesh):
    block = annotated_block(seed)
  provider = q8rules.Q8LoraProvider(lm.rules())
  model = qwix.apply_lora_to_model(block, provider, x, rngs=nnx.Rngs(seed + 1))
  for (name, which), want in ADAPTER_SPECS.items():
    var = getattr(getattr(model, name), f"kernel_lora_{which}")
    check_spec(var[...], want, f"{name} {which.upper()}")
    meta = var.get_metadata()
    assert padded(meta["out_sharding"], 2) == padded(want, 2), (name, which, meta)
    assert meta["eager_sharding"] is False, meta


@pytest.mark.slow
def test_nnx_shard_params_explicit_axes(rng):
  """An nnx LoRA model placed by `shard_params` (kernels' specs only) on a mesh with Explicit
  axes: the adapters follow their base, the products split by the specs in their types; output
  and grads against float64, each gradient typed as its adapter."""
  mesh = mesh_of(AxisType.Explicit)
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  seed = int(rng.integers(2**31))
  provider = q8rules.Q8LoraProvider(lm.rules())
  model = qwix.apply_lora_to_model(lm.NBlock(nnx.Rngs(seed)), provider, x, rngs=nnx.Rngs(seed))
  adapters = lm.random_adapters(rng)
  set_adapters(model, adapters)
  sharding.shard_params(model, mesh, SPECS)
  for (name, which), want in ADAPTER_SPECS.items():
    var = getattr(getattr(model, name), f"kernel_lora_{which}")
    check_spec(var[...], want, f"{name} {which.upper()}")
  out, grads, dx = nnx_run(model, x, c)
  check_numbers(out, grads, dx, reference(nnx_kernels(model), adapters, x, c))
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(grads[name]["ab".index(which)], want, f"d{which.upper()} of {name}")


# ---- stacked layers on the mesh ----------------------------------------------------


@pytest.mark.slow
def test_linen_scan_on_a_mesh(rng):
  """nn.scan(nn.remat(Block)) with stacked specs (the layer axis whole) under shard_products:
  the stacked adapters (L, K, r), (L, r, N) follow their base; output and grads against
  float64."""
  layers = 2
  mesh = mesh_of(AxisType.Auto)
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  model = qwix.quantize_model(lm.Scan(layers), q8rules.Q8LoraProvider(lm.rules("layers/")))
  params = jax.jit(model.init)(lm.key_of(rng), x)["params"]["layers"]
  adapters = lm.random_adapters(rng, (layers,))
  for name in lm.NAMES:
    a, b = adapters[name]
    params[name] = {**params[name], "kernel_lora_a": a, "kernel_lora_b": b}
  specs = {f"layers/{k}": P(None, *v) for k, v in SPECS.items()}
  placed = sharding.shard_params({"layers": params}, mesh, specs)["layers"]
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(placed[name][f"kernel_lora_{which}"], P(None, *want), f"{name} {which.upper()}")
  base, lora = split(placed)

  def apply(lora, x):
    return model.apply({"params": {"layers": {n: {**base[n], **lora[n]} for n in lm.NAMES}}}, x)

  def loss(lora, x):
    out = apply(lora, x)
    return jnp.sum(out * c), out

  with q8rules.shard_products(mesh, specs):
    (g, dx), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(lora, x)
  grads = {n: (g[n]["kernel_lora_a"], g[n]["kernel_lora_b"]) for n in lm.NAMES}
  kernels = {name: params[name]["kernel"] for name in lm.NAMES}
  check_numbers(out, grads, dx, reference(kernels, adapters, x, c, lead=layers))
  for (name, which), want in ADAPTER_SPECS.items():
    check_spec(grads[name]["ab".index(which)], P(None, *want), f"d{which.upper()} of {name}")


# ---- errors ------------------------------------------------------------------------


def test_an_adapter_that_cannot_follow_its_base_is_named(rng):
  """K = 33 rows padded to 64 as Q8_0, the values split in two along K (32 rows each): A's 33
  rows cannot be split so; B (r, N) follows a row-parallel base whole."""
  mesh = mesh_of(AxisType.Auto)
  two = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,), devices=mesh.devices[:2])
  w = np.zeros((64, 8), np.float32)
  w[:33] = rng.standard_normal((33, 8))
  q8 = quantize(w)
  placed = sharding.shard_q8(q8, two, P("tp", None))
  with pytest.raises(
    ValueError,
    match=r"^layer/dot_general0: cannot split LoRA A of shape \(33, 4\) as its Q8_0 base is"
    r" split \(P\('tp', None\)\): an axis of 33 over 2 devices$",
  ):
    place_like_base(jnp.ones((33, 4), jnp.float32), placed.q, "a", "layer/dot_general0")
  b = place_like_base(jnp.ones((4, 8), jnp.float32), placed.q, "b", "layer/dot_general0")
  check_spec(b, P(None, None), "B of a row-parallel base")
