"""`Q8LoraProvider` under `nn.scan` / `nnx.scan` over stacked layers, each step rematerialised
(`nn.remat` / `nnx.remat`): per-layer adapters (L, K, r), (L, r, N) beside the stacked Q8_0
values; outputs and the gradients of A, B and x against a float64 pass through the dequantised
weights; an optax step leaves the base's bytes as they were."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx

import q8rules
from tests import _lora_models as lm
from tests._utils import rel_err

L = 3
"""Stacked layers."""

OUT_TOL, GRAD_TOL = 1e-6, 1e-5
"""Relative (L2) error allowed against float64: outputs, gradients (float32 throughout)."""


def _reference(x, kernels, adapters, c):
  """float64 out, per-layer (dA, dB) and dx of the stacked blocks: `kernels` name -> stacked Q8
  param, `adapters` name -> (A (L, K, r), B (L, r, N))."""
  w = {name: lm.matrix64(kernels[name]) for name in lm.NAMES}
  layers = [
    {
      name: (w[name][i], lm.value(adapters[name][0])[i], lm.value(adapters[name][1])[i])
      for name in lm.NAMES
    }
    for i in range(L)
  ]
  return lm.forward_backward64(x, layers, c)


def _check_grads(got: dict[str, tuple], dx, ref) -> None:
  """`got` name -> stacked (dA, dB) and dx against `_reference`'s."""
  _, ref_layers, ref_dx = ref
  for name in lm.NAMES:
    for j, which in enumerate("AB"):
      want = np.stack([layer[name][j] for layer in ref_layers])
      err = rel_err(got[name][j], want)
      assert err < GRAD_TOL, f"d{which} of {name}: {err:.2e}"
  err = rel_err(dx, ref_dx)
  assert err < GRAD_TOL, f"dx: {err:.2e}"


def _base_bytes(tree) -> list[bytes]:
  return [np.asarray(v).tobytes() for v in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_linen_scan_remat(rng):
  """nn.scan(nn.remat(Block)): stacked Q8 params and adapters (A distinct per layer; B = 0 is
  the Q8Provider model on the same Q8 params bit for bit); random A, B: output, dA, dB, dx against float64; adam on the
  adapters moves them and keeps the base's bytes."""
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  key = lm.key_of(rng)
  model = qwix.quantize_model(lm.Scan(L), q8rules.Q8LoraProvider(lm.rules("layers/")))
  params = jax.jit(model.init)(key, x)["params"]["layers"]
  for name, (k, n) in {"up": (lm.D, lm.F), "down": (lm.F, lm.D)}.items():
    layer = params[name]
    assert set(layer) == {"kernel", "kernel_lora_a", "kernel_lora_b"}
    assert layer["kernel"].array.q.shape == (L, -(-k // 32) * 32, n)
    assert layer["kernel_lora_a"].shape == (L, k, lm.RANK)
    assert layer["kernel_lora_b"].shape == (L, lm.RANK, n) and not np.any(layer["kernel_lora_b"])
    a = np.asarray(layer["kernel_lora_a"])
    assert not np.array_equal(a[0], a[1]), f"{name}: the layers' A are the same draw"
  plain = qwix.quantize_model(lm.Scan(L), q8rules.Q8Provider([q8rules.Q8Rule()]))
  q8_only = {name: {"kernel": params[name]["kernel"]} for name in lm.NAMES}
  want = jax.jit(plain.apply)({"params": {"layers": q8_only}}, x)
  got = jax.jit(model.apply)({"params": {"layers": params}}, x)
  assert np.array_equal(np.asarray(got), np.asarray(want))

  adapters = lm.random_adapters(rng, (L,))
  base = {name: {"kernel": params[name]["kernel"]} for name in lm.NAMES}
  lora = {
    name: {"kernel_lora_a": adapters[name][0], "kernel_lora_b": adapters[name][1]}
    for name in lm.NAMES
  }
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)

  def run(lora, x):
    p = {name: {**base[name], **lora[name]} for name in lm.NAMES}
    return model.apply({"params": {"layers": p}}, x)

  kernels = {name: params[name]["kernel"] for name in lm.NAMES}
  ref = _reference(x, kernels, adapters, c)

  def loss(lora, x):
    out = run(lora, x)
    return jnp.sum(out * c), out

  (g_lora, dx), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(lora, x)
  err = rel_err(out, ref[0])
  assert err < OUT_TOL, f"output: {err:.2e}"
  got = {n: (g_lora[n]["kernel_lora_a"], g_lora[n]["kernel_lora_b"]) for n in lm.NAMES}
  _check_grads(got, dx, ref)

  before = _base_bytes(base)
  tx = optax.adam(1e-2)

  @jax.jit
  def step(lora, state):
    loss, grads = jax.value_and_grad(lambda lo: jnp.mean((run(lo, x) - c) ** 2))(lora)
    updates, state = tx.update(grads, state)
    return optax.apply_updates(lora, updates), state, loss

  new, _, _ = step(lora, tx.init(lora))
  assert _base_bytes(base) == before
  assert _base_bytes(new) != _base_bytes(lora)


@pytest.mark.slow
def test_nnx_scan_remat(rng):
  """nnx.scan over nnx.vmap-made layers (nnx.remat per step, nnx.split_rngs around the scan):
  stacked LoRAParams; random A, B: output, nnx.grad of A, B and x against float64; an
  nnx.Optimizer step on nnx.LoRAParam keeps every other state's bytes."""
  x = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  seed = int(rng.integers(2**31))
  provider = q8rules.Q8LoraProvider(lm.rules("layers/"))
  model = qwix.apply_lora_to_model(
    lm.NScan(nnx.Rngs(seed), L), provider, x, rngs=nnx.Rngs(seed + 1)
  )
  layers = model.layers
  for name, (k, n) in {"up": (lm.D, lm.F), "down": (lm.F, lm.D)}.items():
    layer = getattr(layers, name)
    assert isinstance(layer.kernel_lora_a, nnx.LoRAParam)
    assert layer.kernel_lora_a.shape == (L, k, lm.RANK)
    assert layer.kernel_lora_b.shape == (L, lm.RANK, n)
    a = lm.value(layer.kernel_lora_a)
    assert not np.array_equal(a[0], a[1]), f"{name}: the layers' A are the same draw"

  adapters = lm.random_adapters(rng, (L,))
  for name in lm.NAMES:
    layer = getattr(layers, name)
    layer.kernel_lora_a.value, layer.kernel_lora_b.value = adapters[name]
  c = jnp.asarray(rng.standard_normal(lm.X_SHAPE), jnp.float32)
  kernels = {name: getattr(layers, name).kernel for name in lm.NAMES}
  ref = _reference(x, kernels, adapters, c)

  def loss(m, x):
    out = m(x)
    return jnp.sum(out * c), out

  diff = nnx.DiffState(0, nnx.LoRAParam)
  (grads, dx), out = nnx.jit(nnx.grad(loss, argnums=(diff, 1), has_aux=True))(model, x)
  err = rel_err(out, ref[0])
  assert err < OUT_TOL, f"output: {err:.2e}"
  g = grads["layers"]
  got = {n: (lm.value(g[n]["kernel_lora_a"]), lm.value(g[n]["kernel_lora_b"])) for n in lm.NAMES}
  _check_grads(got, dx, ref)

  base = flax.traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam))))
  before = {k: np.asarray(v).tobytes() for k, v in base.items()}
  lora_before = _base_bytes(nnx.state(model, nnx.LoRAParam))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(m, opt):
    value, grads = nnx.value_and_grad(
      lambda m: jnp.mean((m(x) - c) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam)
    )(m)
    opt.update(m, grads)
    return value

  step(model, optimizer)
  after = flax.traverse_util.flatten_dict(
    nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam)))
  )
  assert {k: np.asarray(v).tobytes() for k, v in after.items()} == before
  assert _base_bytes(nnx.state(model, nnx.LoRAParam)) != lora_before
