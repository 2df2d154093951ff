"""Q8QatProvider: fake quant, the straight-through gradient, training, conversion to serving.

References are independent of q8rules' layout and quantizer code: numpy's
Q8_0 round trip (llama.cpp's `quantize_row_q8_0_ref` with gguf's `np_roundf`)
on explicitly reshaped weights, and the float model run in float64
(models, data and the round trip: tests/_qat_models.py). Rules, non-finite
weights and the digits benchmark: tests/test_qat_usage.py.
"""

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
from q8rules.layout import Q8How, WeightLayout
from q8rules.providers.qat import fake_quant, fake_quant_ste
from q8rules.providers.serving import quantize_weight
from tests._qat_models import (
  LINEN_CONTRACT,
  LINEN_RULES,
  NNX_RULES,
  LinenNet,
  ScanNet,
  data,
  linen_fq_params,
  linen_params,
  mse,
  nnx_fq_params,
  nnx_model,
  np_fq,
  scan_fq_params,
)
from tests._utils import rel_err

pytestmark = pytest.mark.usefixtures(
  "float32_matmuls"
)  # float references: float32 on every backend


def tree_rel_errs(out, ref) -> dict[str, float]:
  """rel_err per leaf, keyed by 'a/b/c'."""
  out = flax.traverse_util.flatten_dict(out, sep="/")
  ref = flax.traverse_util.flatten_dict(ref, sep="/")
  assert out.keys() == ref.keys()
  return {k: rel_err(out[k], ref[k]) for k in ref}


def assert_as_accurate_as_float(grads, float32_grads, float64_grads) -> None:
  """QAT's float32 gradient is about as close to the float64 one as the float model's own
  float32 gradient (at the same fake-quantised weights) is: fake quant adds no error of its
  own. (QAT's forward is the serving kernel, which sums in another order than the float
  model's XLA dot, so its float32 roundings are others: within 1.5x, or 1e-6.)"""
  qat = tree_rel_errs(grads, float64_grads)
  own = tree_rel_errs(float32_grads, float64_grads)
  assert all(qat[k] <= 1.5 * own[k] + 1e-6 for k in qat), (qat, own)
  assert max(own.values()) <= 1e-4, own  # and that is float32 rounding, nothing more


def assert_forward_matches(y_qat, y_serve, y_float32, y_float64, tol: float = 1e-6) -> None:
  """QAT forward == the float model at the fake-quantised weights (float32; within `tol`: QAT
  runs the serving kernels, which sum in their own order), serving == QAT within fp32
  summation order, and both as close to float64 as float32 itself is."""
  assert rel_err(y_qat, y_float32) <= tol
  assert rel_err(y_serve, y_qat) <= tol
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
  params `fq`: within 1e-5 of its float32 value (QAT's forward runs the serving kernel, which
  sums in another order than XLA's float product: the activations, hence the gradients,
  differ in float32's last bits; measured 2e-6), and as close to float64 as float32 is."""
  ref32 = float_grad(jax.tree.map(jnp.asarray, fq), x, y)
  errs = tree_rel_errs(grads, ref32)
  assert max(errs.values()) <= 1e-5, errs
  with jax.enable_x64(True):
    ref64 = jax.tree.map(np.asarray, float_grad(f64(fq), f64(x), f64(y)))
  assert_as_accurate_as_float(grads, ref32, ref64)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
  # QAT's forward is the serving kernel (another float32 summation order than XLA's dot);
  # through these three layers of very different ranges the gradients move by up to 1.05e-5
  assert max(errs.values()) <= 3e-5, errs
  float_apply = jax.jit(model.apply)
  y32 = float_apply({"params": jax.tree.map(jnp.asarray, fq)}, x)
  with jax.enable_x64(True):
    y64 = np.asarray(float_apply({"params": f64(fq)}, f64(x)))
    ref64 = jax.tree.map(np.asarray, float_grad(f64(fq), f64(x), f64(y))[1])
  assert_as_accurate_as_float(grads, ref_grads, ref64)

  # Conversion of the stacked params, and serving under the same scan: the served model
  # runs QAT's forward (the same kernels on the same values), so its output is QAT's; both
  # are float32's distance from the float model at the fake-quantised weights (the native
  # kernel sums per 32-row block: 1.2e-6 through these three layers).
  serving = qwix.quantize_model(model, q8rules.Q8Provider(rules))
  abstract = jax.eval_shape(serving.init, jax.random.key(0), x)["params"]
  q8 = q8rules.quantize_params(params, abstract)
  y_serve = jax.jit(serving.apply)({"params": q8}, x)
  y_qat = jax.jit(qat.apply)({"params": params}, x)
  assert_forward_matches(y_qat, y_serve, y32, y64, tol=3e-6)
  assert rel_err(y_serve, y_qat) <= 1e-6
