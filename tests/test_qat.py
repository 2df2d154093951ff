"""Q8QatProvider: fake quant, the straight-through gradient, training, conversion to serving.

References are independent of q8rules' layout and quantizer code: numpy's
Q8_0 round trip (llama.cpp's `quantize_row_q8_0_ref` with gguf's `np_roundf`)
on explicitly reshaped weights, and the float model run in float64.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from gguf.quants import np_roundf

import q8rules
from q8rules.layout import Q8How, WeightLayout
from q8rules.providers.qat import fake_quant, fake_quant_ste
from q8rules.providers.serving import quantize_weight
from tests._utils import rel_err

pytestmark = pytest.mark.usefixtures(
  "float32_matmuls"
)  # float references: float32 on every backend

F32 = np.float32


def tree_rel_errs(out, ref) -> dict[str, float]:
  """rel_err per leaf, keyed by 'a/b/c'."""
  out = flax.traverse_util.flatten_dict(out, sep="/")
  ref = flax.traverse_util.flatten_dict(ref, sep="/")
  assert out.keys() == ref.keys()
  return {k: rel_err(out[k], ref[k]) for k in ref}


def np_fq_matrix(w2d: np.ndarray, scale_dtype=np.float32) -> np.ndarray:
  """Q8_0 round trip of a (K, N) float32 matrix blocked along K (K padded with zeros), numpy."""
  k, n = w2d.shape
  kp = -(-k // 32) * 32
  w = np.zeros((kp, n), F32)
  w[:k] = w2d
  blocks = w.reshape(kp // 32, 32, n)
  d = np.abs(blocks).max(axis=1, keepdims=True) / F32(127)
  inv = np.where(d == 0, F32(0), F32(1) / np.where(d == 0, F32(1), d)).astype(F32)
  q = np_roundf(blocks * inv)
  d_stored = d.astype(scale_dtype).astype(F32)
  return (q * d_stored).astype(F32).reshape(kp, n)[:k]


def np_fq(w: np.ndarray, n_contract: int, scale_dtype=np.float32) -> np.ndarray:
  """Round trip of a weight whose first `n_contract` axes are contracted (every test weight here)."""
  w = np.asarray(w, F32)
  k = int(np.prod(w.shape[:n_contract]))
  return np_fq_matrix(w.reshape(k, -1), scale_dtype).reshape(w.shape)


def randomize(params, rng: np.random.Generator, scale: float = 0.3):
  """Fresh random float32 params (biases too, so nothing is zero)."""
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, scale, a.shape), a.dtype), params)


# ---- models -------------------------------------------------------------------


class LinenNet(nn.Module):
  """x (B, T, 40) -> (B, T, 10): Dense (K=40, padded), DenseGeneral, two-axis Einsum, unmatched head."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(nn.Dense(96, name="up")(x))
    h = nn.DenseGeneral((4, 8), name="heads")(h)  # kernel (96, 4, 8)
    h = jnp.tanh(nn.Einsum((4, 8, 24), "btnh,nhd->btd", name="out")(h))  # kernel (4, 8, 24)
    return nn.Dense(10, name="head")(h)


LINEN_RULES = [q8rules.Q8Rule(module_path="up|heads|out")]
LINEN_CONTRACT = {"up": 1, "heads": 1, "out": 2}  # matched kernels: leading contracted axes


def linen_fq_params(params, scale_dtype=np.float32):
  """The params with every matched kernel replaced by its numpy Q8_0 round trip."""
  out = jax.tree.map(np.asarray, flax.core.unfreeze(params))
  for name, nc in LINEN_CONTRACT.items():
    out[name]["kernel"] = np_fq(out[name]["kernel"], nc, scale_dtype)
  return out


class NnxNet(nnx.Module):
  """x (B, T, 40) -> (B, T, 24): nnx.Linear (K=40), nnx.Einsum, jnp.dot on a raw Param.

  (Weight shapes as LinenNet's, so eager conversions reuse compiled ops.)
  """

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(40, 96, rngs=rngs)
    self.ein = nnx.Einsum("btd,dnh->btnh", (96, 4, 8), (4, 8), rngs=rngs)
    self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 24)) / 6)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jnp.tanh(self.ein(jax.nn.gelu(self.up(x))))
    return jnp.dot(h.reshape(*h.shape[:-2], 32), self.w[...])


NNX_RULES = [q8rules.Q8Rule()]


def nnx_fq_params(pure: dict) -> dict:
  out = jax.tree.map(np.asarray, pure)
  out["up"]["kernel"] = np_fq(out["up"]["kernel"], 1)
  out["ein"]["kernel"] = np_fq(out["ein"]["kernel"], 1)
  out["w"] = np_fq(out["w"], 1)
  return out


def nnx_model(rng: np.random.Generator) -> NnxNet:
  """An NnxNet with fresh random params (built abstractly: no eager init ops)."""
  net = nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0)))
  nnx.update(net, randomize(nnx.state(net, nnx.Param), rng))
  return net


def linen_params(model: nn.Module, x: jax.Array, rng: np.random.Generator):
  """Fresh random params of the model's structure (built abstractly: no eager init ops)."""
  return randomize(jax.eval_shape(model.init, jax.random.key(0), x)["params"], rng)


def assert_as_accurate_as_float(grads, float32_grads, float64_grads) -> None:
  """QAT's float32 gradient is as close to the float64 one as the float model's own float32
  gradient (at the same fake-quantised weights) is: fake quant adds no error of its own."""
  qat = tree_rel_errs(grads, float64_grads)
  own = tree_rel_errs(float32_grads, float64_grads)
  assert all(qat[k] <= 1.01 * own[k] + 1e-7 for k in qat), (qat, own)
  assert max(own.values()) <= 1e-4, own  # and that is float32 rounding, nothing more


def assert_forward_matches(y_qat, y_serve, y_float32, y_float64) -> None:
  """QAT forward == the float model at the fake-quantised weights (float32, same ops), serving
  == QAT within fp32 summation order, and both as close to float64 as float32 itself is."""
  assert rel_err(y_qat, y_float32) <= 1e-6
  assert rel_err(y_serve, y_qat) <= 1e-6
  own = rel_err(y_float32, y_float64)
  assert own <= 1e-5
  assert rel_err(y_qat, y_float64) <= 1.01 * own + 1e-7
  assert rel_err(y_serve, y_float64) <= 2 * own + 1e-6


def f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def nnx_float_fn(net: nnx.Module):
  """(pure params dict, x) -> net's output, for the float model with those params."""
  graphdef, state = nnx.split(net)

  def fn(pure, xx):
    st = jax.tree.map(lambda a: a, state)
    nnx.replace_by_pure_dict(st, pure)
    return nnx.merge(graphdef, st)(xx)

  return fn


def data(
  rng: np.random.Generator, b: int = 4, t: int = 3, out: int = 10
) -> tuple[jax.Array, jax.Array]:
  """Inputs float32 (b, t, 40) and regression targets float32 (b, t, out)."""
  x = jnp.asarray(rng.normal(size=(b, t, 40)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(b, t, out)), jnp.float32)
  return x, y


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((pred - y) ** 2)


# ---- the fake quant itself ----------------------------------------------------


@pytest.mark.parametrize(
  "shape, contract, scale_dtype, dtype",
  [
    ((40, 96), (0,), np.float32, jnp.float32),  # K padded 40 -> 64
    ((96, 4, 8), (0,), np.float16, jnp.float32),
    ((4, 8, 24), (0, 1), np.float32, jnp.float32),
    ((40, 96), (0,), np.float32, jnp.bfloat16),
  ],
)
def test_fake_quant_is_the_serving_round_trip(rng, shape, contract, scale_dtype, dtype):
  free = tuple(a for a in range(len(shape)) if a not in contract)
  layout = WeightLayout(shape, contract, free)
  w = jnp.asarray(rng.normal(0, 0.2, shape), dtype)
  fq = jax.jit(fake_quant, static_argnums=(1, 2))(w, layout, np.dtype(scale_dtype).name)
  assert fq.shape == w.shape and fq.dtype == w.dtype
  # numpy reference (independent layout code): bit-equal in float32, then cast.
  ref = np_fq(np.asarray(w.astype(jnp.float32)), len(contract), scale_dtype)
  np.testing.assert_array_equal(np.asarray(fq), np.asarray(jnp.asarray(ref).astype(dtype)))
  # the serving provider's quantize_weight, dequantized: the very same values.
  how = Q8How(layout, np.dtype(scale_dtype).name, np.dtype(dtype).name)
  served = jax.jit(lambda a: layout.from_matrix(q8rules.dequantize(quantize_weight(a, how))))(w)
  np.testing.assert_array_equal(np.asarray(fq), np.asarray(served))
  assert not np.array_equal(np.asarray(fq), np.asarray(w))  # it does quantize
  # straight-through: forward bit-equal, tangent the identity.
  t = jnp.asarray(rng.normal(size=shape), dtype)
  out, tangent = jax.jvp(
    lambda a: fake_quant_ste(a, layout, np.dtype(scale_dtype).name), (w,), (t,)
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(fq))
  np.testing.assert_array_equal(np.asarray(tangent), np.asarray(t))


# ---- the straight-through gradient ---------------------------------------------


def assert_ste_identity(grads, float_grad, fq, x, y) -> None:
  """QAT `grads` equal `float_grad` (the float model's, jitted) at the fake-quantised
  params `fq`: within 1e-6 of its float32 value, and as close to float64 as float32 is."""
  ref32 = float_grad(jax.tree.map(jnp.asarray, fq), x, y)
  errs = tree_rel_errs(grads, ref32)
  assert max(errs.values()) <= 1e-6, errs
  with jax.enable_x64(True):
    ref64 = jax.tree.map(np.asarray, float_grad(f64(fq), f64(x), f64(y)))
  assert_as_accurate_as_float(grads, ref32, ref64)


def test_ste_gradient_linen(rng):
  x, y = data(rng)
  model = LinenNet()
  params = linen_params(model, x, rng)
  provider = q8rules.Q8QatProvider(LINEN_RULES)
  qat = qwix.quantize_model(model, provider)

  grads = jax.jit(jax.grad(lambda p: mse(qat.apply({"params": p}, x), y)))(params)
  paths = provider.report().paths()
  assert paths == {
    "up/dot_general0": "fake_quant",
    "heads/dot_general0": "fake_quant",
    "out/einsum0": "fake_quant",
    "head/dot_general0": "float",
  }

  float_grad = jax.jit(jax.grad(lambda p, xx, yy: mse(model.apply({"params": p}, xx), yy)))
  # STE identity: the float model's gradient at the (numpy) fake-quantised weights.
  assert_ste_identity(grads, float_grad, linen_fq_params(params), x, y)
  for name in LINEN_CONTRACT:
    assert np.count_nonzero(np.asarray(grads[name]["kernel"])) > 0.9 * grads[name]["kernel"].size
  # and it is not the float gradient at the unquantised weights (the test can tell them apart)
  at_w = float_grad(params, x, y)
  assert rel_err(grads["up"]["kernel"], at_w["up"]["kernel"]) > 1e-4


def test_ste_gradient_nnx(rng):
  x, y = data(rng, out=24)
  net = nnx_model(rng)
  pure = nnx.to_pure_dict(nnx.state(net, nnx.Param))
  qat = qwix.quantize_model(net, q8rules.Q8QatProvider(NNX_RULES), x)

  @nnx.jit
  def qat_grads(m):
    return nnx.grad(lambda m: mse(m(x), y))(m)

  grads = nnx.to_pure_dict(qat_grads(qat))
  fn = nnx_float_fn(net)
  float_grad = jax.jit(jax.grad(lambda p, xx, yy: mse(fn(p, xx), yy)))
  assert_ste_identity(grads, float_grad, nnx_fq_params(pure), x, y)
  for leaf in (grads["up"]["kernel"], grads["ein"]["kernel"], grads["w"]):
    assert np.count_nonzero(np.asarray(leaf)) > 0.9 * leaf.size


# ---- training and conversion ------------------------------------------------------


def test_linen_trains_and_converts_to_serving(rng):
  x, y = data(rng, b=8)
  model = LinenNet()
  params = linen_params(model, x, rng)
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider(LINEN_RULES))
  tx = optax.adam(1e-2)

  @jax.jit
  def step(p, s):
    loss, g = jax.value_and_grad(lambda p: mse(qat.apply({"params": p}, x), y))(p)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss, g

  p, s = params, tx.init(params)
  losses = []
  for _ in range(30):
    p, s, loss, g = step(p, s)
    losses.append(float(loss))
    assert all(np.any(np.asarray(g[n]["kernel"])) for n in LINEN_CONTRACT)
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], losses
  assert all(
    jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), p, params))
  )  # params are float and were all updated
  assert jax.tree.map(lambda a: a.dtype, p) == jax.tree.map(lambda a: a.dtype, params)

  # Conversion: QAT params -> Q8 params of the serving model; serving == QAT forward.
  serving = qwix.quantize_model(model, q8rules.Q8Provider(LINEN_RULES))
  abstract = jax.eval_shape(serving.init, jax.random.key(0), x)["params"]
  q8 = q8rules.quantize_params(p, abstract)
  x_new, _ = data(rng, b=5)
  y_serve = jax.jit(serving.apply)({"params": q8}, x_new)
  y_qat = jax.jit(qat.apply)({"params": p}, x_new)
  assert rel_err(y_serve, y_qat) <= 1e-6
  float_apply = jax.jit(model.apply)
  fq = linen_fq_params(p)
  y32 = float_apply({"params": jax.tree.map(jnp.asarray, fq)}, x_new)
  with jax.enable_x64(True):
    y64 = np.asarray(float_apply({"params": f64(fq)}, f64(x_new)))
  assert_forward_matches(y_qat, y_serve, y32, y64)
  assert rel_err(float_apply({"params": p}, x_new), y64) > 1e-4  # quantization is visible


def test_nnx_trains_and_converts_to_serving(rng):
  x, y = data(rng, b=8, out=24)
  net = nnx_model(rng)
  qat = qwix.quantize_model(net, q8rules.Q8QatProvider(NNX_RULES), x)
  opt = nnx.Optimizer(qat, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(m, o):
    loss, g = nnx.value_and_grad(lambda m: mse(m(x), y))(m)
    o.update(m, g)
    return loss

  before = nnx.to_pure_dict(nnx.state(qat, nnx.Param))
  losses = [float(step(qat, opt)) for _ in range(30)]
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], losses
  trained = nnx.to_pure_dict(nnx.state(qat, nnx.Param))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), trained, before)))

  serving = qwix.quantize_model(net, q8rules.Q8Provider(NNX_RULES), x)
  q8 = q8rules.quantize_params(trained, serving)
  nnx.update(serving, q8)
  x_new, _ = data(rng, b=5)
  y_serve = nnx.jit(lambda m, a: m(a))(serving, x_new)
  y_qat = nnx.jit(lambda m, a: m(a))(qat, x_new)
  assert rel_err(y_serve, y_qat) <= 1e-6
  float_fn = jax.jit(nnx_float_fn(net))
  fq = nnx_fq_params(trained)
  y32 = float_fn(jax.tree.map(jnp.asarray, fq), x_new)
  with jax.enable_x64(True):
    y64 = np.asarray(float_fn(f64(fq), f64(x_new)))
  assert_forward_matches(y_qat, y_serve, y32, y64)
  assert rel_err(float_fn(trained, x_new), y64) > 1e-4  # quantization is visible


# ---- nn.scan over remat layers -------------------------------------------------------


class Block(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    h = jnp.tanh(nn.Dense(64, name="fc1")(x))  # kernel (48, 64): K padded to 64
    return x + nn.Dense(48, name="fc2")(h), None  # kernel (64, 48)


class ScanNet(nn.Module):
  """x (B, 48) -> (B, 10) through 3 scanned, rematerialised blocks (params stacked on axis 0)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    layers = nn.scan(
      nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, _ = layers(name="layers")(x, None)
    return nn.Dense(10, name="head")(x)


def scan_fq_params(params):
  out = jax.tree.map(np.asarray, flax.core.unfreeze(params))
  for fc in ("fc1", "fc2"):
    stacked = out["layers"][fc]["kernel"]
    out["layers"][fc]["kernel"] = np.stack([np_fq(w, 1) for w in stacked])  # each layer alone
  return out


def test_scan_remat_quantizes_each_layer_slice(rng):
  x = jnp.asarray(rng.normal(size=(6, 48)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(6, 10)), jnp.float32)
  model = ScanNet()
  params = linen_params(model, x, rng)
  # Make the layers' ranges differ a lot: quantizing the stack as one would show.
  params["layers"]["fc1"]["kernel"] *= jnp.asarray([1.0, 8.0, 0.05])[:, None, None]
  assert params["layers"]["fc1"]["kernel"].shape == (3, 48, 64)
  rules = [q8rules.Q8Rule(module_path="layers/fc.")]
  provider = q8rules.Q8QatProvider(rules)
  qat = qwix.quantize_model(model, provider)

  def qat_loss(p):
    return mse(qat.apply({"params": p}, x), y)

  loss, grads = jax.jit(jax.value_and_grad(qat_loss))(params)
  records = {f"{r.module}/{r.op}": r for r in provider.report().ops}
  assert records["layers/fc1/dot_general0"].path == "fake_quant"
  assert records["layers/fc1/dot_general0"].weight_shape == (48, 64)  # the per-layer slice
  assert records["layers/fc2/dot_general0"].weight_shape == (64, 48)
  assert records["head/dot_general0"].path == "float"

  float_grad = jax.jit(
    jax.value_and_grad(lambda p, xx, yy: mse(model.apply({"params": p}, xx), yy))
  )
  fq = scan_fq_params(params)  # each layer's slice quantized alone, in numpy
  ref_loss, ref_grads = float_grad(jax.tree.map(jnp.asarray, fq), x, y)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  errs = tree_rel_errs(grads, ref_grads)
  assert max(errs.values()) <= 1e-6, errs
  float_apply = jax.jit(model.apply)
  y32 = float_apply({"params": jax.tree.map(jnp.asarray, fq)}, x)
  with jax.enable_x64(True):
    y64 = np.asarray(float_apply({"params": f64(fq)}, f64(x)))
    ref64 = jax.tree.map(np.asarray, float_grad(f64(fq), f64(x), f64(y))[1])
  assert_as_accurate_as_float(grads, ref_grads, ref64)

  # Conversion of the stacked params, and serving under the same scan. Served on the
  # XLA path: through three scanned layers the native CPU kernel's summation order
  # differs from the QAT forward's by 1.2e-6 (it is the closer of the two to float64:
  # 6.7e-7 against 9.0e-7), past this test's 1e-6; the one-layer parity tests run it.
  serving_rules = [dataclasses.replace(r, implementation="xla") for r in rules]
  serving = qwix.quantize_model(model, q8rules.Q8Provider(serving_rules))
  abstract = jax.eval_shape(serving.init, jax.random.key(0), x)["params"]
  q8 = q8rules.quantize_params(params, abstract)
  y_serve = jax.jit(serving.apply)({"params": q8}, x)
  y_qat = jax.jit(qat.apply)({"params": params}, x)
  assert_forward_matches(y_qat, y_serve, y32, y64)


# ---- rules and non-finite weights ----------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, words",
  [
    ({"act_qtype": "int8"}, "act_qtype"),
    ({"tile_size": 64}, "tile_size"),
    ({"weight_calibration_method": "rms,3"}, "weight_calibration_method"),
    ({"scale_dtype": jnp.bfloat16}, "scale_dtype"),
  ],
)
def test_rule_qat_cannot_honour_raises(kwargs, words):
  """Refused when the rule is made, the reason first (before the rule's long repr)."""
  with pytest.raises(ValueError, match=f"^Q8Rule cannot honour {words}"):
    q8rules.Q8QatProvider([q8rules.Q8Rule(**kwargs)])


def test_qat_provider_wants_a_q8rule():
  with pytest.raises(TypeError, match="Q8QatProvider takes q8rules.Q8Rule"):
    q8rules.Q8QatProvider([qwix.QtRule(weight_qtype="int8")])


def test_serving_only_options_are_ignored_and_reported(rng):
  """implementation/interpret pick the serving kernel, not the value: QAT accepts them."""
  x, _ = data(rng)
  model = LinenNet()
  params = linen_params(model, x, rng)
  outs, reports = [], []
  for rule in (
    q8rules.Q8Rule(module_path="up|heads|out"),
    q8rules.Q8Rule(module_path="up|heads|out", implementation="fold", interpret=True),
  ):
    provider = q8rules.Q8QatProvider([rule])
    outs.append(
      np.asarray(jax.jit(qwix.quantize_model(model, provider).apply)({"params": params}, x))
    )
    reports.append(provider.report())
  np.testing.assert_array_equal(outs[0], outs[1])
  assert "implementation/interpret apply when serving" in reports[1].ops[0].note
  assert "implementation" not in reports[0].ops[0].note


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weight(rng, bad):
  x, y = data(rng)
  model = LinenNet()
  params = linen_params(model, x, rng)
  params["heads"]["kernel"] = params["heads"]["kernel"].at[7, 1, 2].set(bad)
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider(LINEN_RULES))
  # Training: the loss is nan, as float training with that weight would make it; no error,
  # no silent repair.
  loss = jax.jit(lambda p: mse(qat.apply({"params": p}, x), y))(params)
  assert np.isnan(float(loss))
  # The nan stays in its 32-block (rows 0..31 of column (1, 2)); the other blocks are as usual.
  w = params["heads"]["kernel"]
  layout = WeightLayout((96, 4, 8), (0,), (1, 2))
  fq = np.asarray(jax.jit(lambda a: fake_quant_ste(a, layout, "float32"))(w))
  block = np.zeros(w.shape, bool)
  block[:32, 1, 2] = True
  assert np.isnan(fq[block]).all()
  w_ok = np.asarray(w).copy()
  w_ok[7, 1, 2] = 0.0
  np.testing.assert_array_equal(fq[~block], np_fq(w_ok, 1)[~block])
  # Conversion refuses, naming the param.
  serving = qwix.quantize_model(model, q8rules.Q8Provider(LINEN_RULES))
  abstract = jax.eval_shape(serving.init, jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="heads/kernel.*non-finite"):
    q8rules.quantize_params(params, abstract)


def test_non_finite_weight_nnx_and_stacked(rng):
  x, _ = data(rng)
  net = nnx_model(rng)
  serving = qwix.quantize_model(net, q8rules.Q8Provider(NNX_RULES), x)
  pure = nnx.to_pure_dict(nnx.state(net, nnx.Param))
  pure["w"] = pure["w"].at[3, 4].set(np.nan)
  with pytest.raises(ValueError, match="cannot quantize w to Q8_0.*non-finite"):
    q8rules.quantize_params(pure, serving)
  # stacked (nn.scan) params: the layer with the nan is found too
  xs = jnp.asarray(rng.normal(size=(2, 48)), jnp.float32)
  model = ScanNet()
  params = linen_params(model, xs, rng)
  params["layers"]["fc2"]["kernel"] = params["layers"]["fc2"]["kernel"].at[2, 0, 0].set(np.nan)
  scanned = qwix.quantize_model(
    model, q8rules.Q8Provider([q8rules.Q8Rule(module_path="layers/.*")])
  )
  abstract = jax.eval_shape(scanned.init, jax.random.key(0), xs)["params"]
  with pytest.raises(ValueError, match="layers/fc2/kernel.*non-finite"):
    q8rules.quantize_params(params, abstract)


# ---- the digits benchmark, quick -----------------------------------------------------


def _benchmark():
  path = Path(__file__).resolve().parents[1] / "benchmarks" / "qat_digits.py"
  spec = importlib.util.spec_from_file_location("qat_digits", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_digits_quick():
  bench = _benchmark()
  t = time.perf_counter()
  r = bench.run(float_epochs=10, qat_epochs=1, timing_steps=20, timing_batches=(64,))
  seconds = time.perf_counter() - t
  acc = r["acc"]
  assert acc["float"] > 0.9, acc
  assert abs(acc["ptq"] - acc["float"]) <= 0.02, acc  # Q8_0 PTQ is close to float here
  assert acc["qat"] > 0.9, acc
  # served QAT model == QAT forward pass on the real task
  assert r["predictions_served_eq_qat_forward"]
  assert r["logit_rel_err_served_vs_qat_forward"] <= 1e-6
  assert 1e-5 < r["logit_rel_err_ptq_vs_float"] < 0.05
  assert "fake_quant" in r["report"]
  times = r["step_seconds"][64]
  assert 0 < times["float"] and 0 < times["qat"], times  # speed: benchmarks/RESULTS.md
  section = bench.section(r, date="today", command="pytest", seconds=seconds)
  assert section.startswith(bench.START) and section.endswith(bench.END)
  assert "## QAT on digits" in section


def test_results_section_replaces_only_its_own(tmp_path):
  bench = _benchmark()
  path = tmp_path / "RESULTS.md"
  path.write_text("# Results\n\n## Other\nkeep me\n")
  bench.write_section(f"{bench.START}\nfirst\n{bench.END}", path)
  bench.write_section(f"{bench.START}\nsecond\n{bench.END}", path)
  text = path.read_text()
  assert "keep me" in text and "second" in text and "first" not in text
  assert text.count(bench.START) == 1
