"""Q8Provider on unmodified linen and nnx models, against float64 references."""

from __future__ import annotations

import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from qwix._src.providers.ptq import WithAux

import q8rules
from q8rules.kernels.native import library as native_lib
from q8rules.q8_0 import BLOCK
from tests._utils import rel_err

pytestmark = pytest.mark.usefixtures(
  "float32_matmuls"
)  # float references: float32 on every backend


def dequantized_f64(w: WithAux) -> np.ndarray:
  """A Q8 weight back in its float shape, in float64 (numpy only)."""
  how = w.how
  layout = how.layout
  q = np.asarray(w.array.q, np.float64)
  d = np.repeat(np.asarray(w.array.scale, np.float64), BLOCK, axis=0)
  order = layout.contract + layout.free
  moved = (q * d)[: layout.k].reshape([layout.shape[a] for a in order])
  return np.transpose(moved, np.argsort(order))


def default_path(m: int, k: int, n: int, dtype=jnp.float32) -> str:
  """What `implementation=None` runs on this backend for an (m, K) x (K, N) product (K padded
  to whole blocks). On CPU that is the native kernel where it builds (else XLA), never the fold."""
  k_pad = -(-k // BLOCK) * BLOCK
  path = q8rules.kernels.resolve_product(m, k_pad, n, dtype)
  if jax.default_backend() == "cpu":
    assert path == ("cpu" if native_lib.available() and m <= 16 else "xla")
  return path


def assert_default_paths(report: q8rules.Report, dtype=jnp.float32) -> None:
  """Every quantized op of `report` took the path `implementation=None` picks for its shape."""
  for r in report.ops:
    if r.q8_bytes:
      assert r.path == default_path(r.m, r.k, r.n, dtype), (r.module, r.op, r.path)


def as_f64(leaf) -> np.ndarray:
  return dequantized_f64(leaf) if isinstance(leaf, WithAux) else np.asarray(leaf, np.float64)


# ---- linen --------------------------------------------------------------------


class Custom(nn.Module):
  """jnp.dot against a raw param: not a Flax layer at all."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.5), (x.shape[-1], 24))
    return jnp.dot(x, w)


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):  # x (B, T, 64)
    h = nn.Dense(96, name="up")(x)
    h = nn.DenseGeneral((4, 8), name="heads")(jax.nn.relu(h))  # (B, T, 4, 8)
    h = nn.Einsum((4, 8, 40), "btnh,nhd->btd", name="out")(h)  # two contraction axes
    h = nn.Dense(40, name="odd")(h)  # K = 40: padded to 64
    return Custom(name="custom")(h)


def linen_reference(p, x):
  """LinenNet in float64 numpy from (dequantized) params."""
  f = {k: {n: as_f64(v) for n, v in layer.items()} for k, layer in p.items()}
  x = np.asarray(x, np.float64)
  h = x @ f["up"]["kernel"] + f["up"]["bias"]
  h = np.einsum("btd,dnh->btnh", np.maximum(h, 0), f["heads"]["kernel"]) + f["heads"]["bias"]
  h = np.einsum("btnh,nhd->btd", h, f["out"]["kernel"]) + f["out"]["bias"]
  h = h @ f["odd"]["kernel"] + f["odd"]["bias"]
  return h @ f["custom"]["w"]


@pytest.fixture(scope="module")
def linen_setup():
  model = LinenNet()
  x = jax.random.normal(jax.random.key(1), (2, 3, 64))
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8_model = qwix.quantize_model(model, provider)
  q8_vars = q8_model.init(jax.random.key(2), x)
  return model, q8_model, provider, q8_vars, x


def test_linen_matches_float64_reference(linen_setup, rng):
  _, q8_model, provider, q8_vars, _ = linen_setup
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  y = q8_model.apply(q8_vars, x)
  assert rel_err(y, linen_reference(q8_vars["params"], x)) <= 1e-6
  paths = provider.report().paths()
  assert paths == {
    "up/dot_general0": default_path(6, 64, 96),
    "heads/dot_general0": default_path(6, 96, 32),
    "out/einsum0": default_path(6, 32, 40),
    "odd/dot_general0": default_path(6, 40, 40),
    "custom/dot_general0": default_path(6, 40, 24),
  }


def test_linen_params_hold_no_float_copy(linen_setup):
  *_, q8_vars, _ = linen_setup
  params = q8_vars["params"]
  for name in ("up", "heads", "out", "odd"):
    w = params[name]["kernel"]
    assert isinstance(w, WithAux) and isinstance(w.array, q8rules.Q8Array)
    assert w.array.q.dtype == jnp.int8
  assert isinstance(params["custom"]["w"], WithAux)
  # the two-axis contraction of 'out' is flattened into K = 4 * 8
  assert params["out"]["kernel"].array.q.shape == (32, 40)
  assert params["heads"]["kernel"].array.q.shape == (96, 32)
  # K = 40 is zero-padded to 64; the pad holds zeros and zero scales
  odd = params["odd"]["kernel"].array
  assert odd.q.shape == (64, 40) and odd.scale.shape == (2, 40)
  assert not np.asarray(odd.q[40:]).any()
  weights = {p: v for p, v in flax.traverse_util.flatten_dict(params).items() if p[-1] != "bias"}
  assert len(weights) == 5 and all(isinstance(v, WithAux) for v in weights.values())


def test_report_notes_padding_and_bytes(linen_setup):
  *_, provider, _, _ = linen_setup
  report = provider.report()
  odd = next(r for r in report.ops if r.module == "odd")
  assert odd.note == "K padded 40 -> 64"
  up = next(r for r in report.ops if r.module == "up")
  assert (up.k, up.n, up.float_bytes, up.q8_bytes) == (64, 96, 64 * 96 * 4, 64 * 96 + 2 * 96 * 4)
  assert "K padded 40 -> 64" in str(report)


@pytest.mark.slow
def test_quantize_params_equals_init(linen_setup):
  model, q8_model, _, q8_vars, x = linen_setup
  float_params = model.init(jax.random.key(2), x)["params"]
  abstract = jax.eval_shape(q8_model.init, jax.random.key(2), x)["params"]
  converted = q8rules.quantize_params(float_params, abstract)
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), converted, q8_vars["params"])
  assert all(jax.tree.leaves(same))
  assert jax.tree.structure(converted) == jax.tree.structure(q8_vars["params"])


@pytest.mark.slow
def test_rule_module_path_excludes_a_layer(rng):
  model = LinenNet()
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule(module_path="up|out")])
  q8_model = qwix.quantize_model(model, provider)
  q8_vars = q8_model.init(jax.random.key(0), x)
  params = q8_vars["params"]
  assert isinstance(params["up"]["kernel"], WithAux)
  assert isinstance(params["out"]["kernel"], WithAux)
  assert isinstance(params["heads"]["kernel"], jax.Array)  # left float
  assert isinstance(params["custom"]["w"], jax.Array)
  paths = provider.report().paths()
  assert paths["heads/dot_general0"] == "float" and paths["up/dot_general0"] == default_path(
    6, 64, 96
  )
  y = q8_model.apply(q8_vars, x)
  assert rel_err(y, linen_reference(params, x)) <= 1e-6


def test_op_names_restrict_the_rule(rng):
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule(op_names=("einsum",))])
  params = qwix.quantize_model(LinenNet(), provider).init(jax.random.key(0), x)["params"]
  assert isinstance(params["out"]["kernel"], WithAux)
  assert isinstance(params["up"]["kernel"], jax.Array)


def test_unused_rule_is_named(rng):
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  provider = q8rules.Q8Provider(
    [q8rules.Q8Rule(module_path="up"), q8rules.Q8Rule(module_path="decoder/.*")]
  )
  with pytest.warns(
    UserWarning, match=r"rule matched nothing: Q8Rule\(module_path='decoder/\.\*'\)"
  ):
    qwix.quantize_model(LinenNet(), provider).init(jax.random.key(0), x)
  report = provider.report()
  assert [r.module_path for r in report.unused_rules] == ["decoder/.*"]
  assert "rule matched nothing: Q8Rule(module_path='decoder/.*')" in str(report)


def test_jit_vmap_grad(linen_setup, rng):
  model, q8_model, _, q8_vars, _ = linen_setup
  x = jnp.asarray(rng.standard_normal((5, 2, 3, 64)), jnp.float32)
  ref = np.stack([linen_reference(q8_vars["params"], xi) for xi in x])
  apply = lambda xi: q8_model.apply(q8_vars, xi)  # noqa: E731
  assert rel_err(jax.jit(apply)(x[0]), ref[0]) <= 1e-6
  assert rel_err(jax.jit(jax.vmap(apply))(x), ref) <= 1e-6
  # grad w.r.t. activations equals the float model's with the dequantized weights
  float_params = jax.tree.map(
    lambda w: jnp.asarray(as_f64(w), jnp.float32),
    q8_vars["params"],
    is_leaf=lambda w: isinstance(w, WithAux),
  )
  loss_q = lambda xi: jnp.sum(jnp.sin(apply(xi)))  # noqa: E731
  loss_f = lambda xi: jnp.sum(jnp.sin(model.apply({"params": float_params}, xi)))  # noqa: E731
  g_q, g_f = jax.jit(jax.grad(loss_q))(x[0]), jax.jit(jax.grad(loss_f))(x[0])
  assert rel_err(g_q, g_f) <= 1e-5


def test_bf16_activations(linen_setup, rng):
  _, q8_model, _, q8_vars, _ = linen_setup
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
  y = q8_model.apply(q8_vars, x)
  # Flax promotes x to the float32 params' dtype, as the float model does
  assert y.dtype == jnp.float32
  assert rel_err(y, linen_reference(q8_vars["params"], np.asarray(x, np.float64))) <= 1e-6
  # a bfloat16 model: Flax casts x and the bias to bfloat16; the product accumulates in fp32
  model = nn.Dense(48, dtype=jnp.bfloat16)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  variables = qwix.quantize_model(model, provider).init(jax.random.key(0), x)
  out = qwix.quantize_model(model, provider).apply(variables, x)
  assert out.dtype == jnp.bfloat16
  p = variables["params"]
  ref = np.asarray(x, np.float64) @ dequantized_f64(p["kernel"]) + np.asarray(
    jnp.asarray(p["bias"], jnp.bfloat16), np.float64
  )
  assert rel_err(out, ref) <= 4e-3  # the bfloat16 rounding of the result


# ---- nnx ----------------------------------------------------------------------


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(64, 96, rngs=rngs)
    self.heads = nnx.LinearGeneral(96, (4, 8), rngs=rngs)
    self.out = nnx.Einsum("btnh,nhd->btd", (4, 8, 40), (40,), rngs=rngs)
    self.w = nnx.Param(jax.random.normal(rngs.params(), (40, 24)) * 0.5)

  def __call__(self, x):
    h = self.heads(jax.nn.relu(self.up(x)))
    return jnp.dot(self.out(h), self.w[...])


def nnx_reference(state: dict, x) -> np.ndarray:
  f = jax.tree.map(as_f64, state, is_leaf=lambda w: isinstance(w, WithAux))
  x = np.asarray(x, np.float64)
  h = np.maximum(x @ f["up"]["kernel"] + f["up"]["bias"], 0)
  h = np.einsum("btd,dnh->btnh", h, f["heads"]["kernel"]) + f["heads"]["bias"]
  h = np.einsum("btnh,nhd->btd", h, f["out"]["kernel"]) + f["out"]["bias"]
  return h @ f["w"]


def nnx_q8_state(model: nnx.Module) -> dict:
  """The Q8 model's params as a dict of WithAux / arrays."""
  return {
    "up": {"kernel": model.up.kernel[...], "bias": model.up.bias[...]},
    "heads": {"kernel": model.heads.kernel[...], "bias": model.heads.bias[...]},
    "out": {"kernel": model.out.kernel[...], "bias": model.out.bias[...]},
    "w": model.w[...],
  }


def test_nnx_matches_float64_reference(rng):
  model = NnxNet(nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  float_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8_model = qwix.quantize_model(model, provider, x)
  state = nnx_q8_state(q8_model)
  for name in ("up", "heads", "out"):
    assert isinstance(state[name]["kernel"], WithAux)
  assert isinstance(state["w"], WithAux)
  x2 = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  assert rel_err(q8_model(x2), nnx_reference(state, x2)) <= 1e-6
  assert rel_err(nnx.jit(lambda m, v: m(v))(q8_model, x2), nnx_reference(state, x2)) <= 1e-6
  assert_default_paths(provider.report())
  # quantize_params from the float checkpoint equals what quantize_model made
  converted = q8rules.quantize_params(float_params, q8_model)
  fresh = qwix.quantize_model(NnxNet(nnx.Rngs(1)), q8rules.Q8Provider([q8rules.Q8Rule()]), x)
  nnx.update(fresh, converted)
  assert rel_err(fresh(x2), nnx_reference(state, x2)) <= 1e-6
  np.testing.assert_array_equal(fresh.up.kernel[...].array.q, state["up"]["kernel"].array.q)


# ---- bad input ----------------------------------------------------------------


def test_rule_with_unsupported_option():
  with pytest.raises(ValueError, match="act_qtype.*weight-only"):
    q8rules.Q8Provider([q8rules.Q8Rule(act_qtype=jnp.int8)])
  with pytest.raises(ValueError, match="tile_size"):
    q8rules.Q8Provider([q8rules.Q8Rule(tile_size=64)])
  with pytest.raises(ValueError, match="scale_dtype"):
    q8rules.Q8Provider([q8rules.Q8Rule(scale_dtype=jnp.bfloat16)])
  with pytest.raises(ValueError, match="implementation"):
    q8rules.Q8Provider([q8rules.Q8Rule(implementation="cuda")])
  with pytest.raises(TypeError, match="takes q8rules.Q8Rule"):
    q8rules.Q8Provider([qwix.QuantizationRule(weight_qtype=jnp.int8)])


def test_non_finite_weight_names_the_param(linen_setup):
  model, q8_model, _, _, x = linen_setup
  params = model.init(jax.random.key(0), x)["params"]
  params["heads"]["kernel"] = params["heads"]["kernel"].at[3, 1, 2].set(jnp.nan)
  abstract = jax.eval_shape(q8_model.init, jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="heads/kernel.*non-finite"):
    q8rules.quantize_params(params, abstract)


def test_non_finite_weight_at_init_names_the_module():
  class NanInit(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, kernel_init=lambda *a: jnp.full((32, 8), jnp.inf), name="bad")(x)

  q8_model = qwix.quantize_model(NanInit(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  with pytest.raises(ValueError, match="bad.*non-finite"):
    q8_model.init(jax.random.key(0), jnp.ones((1, 32)))


def test_integer_weight_is_refused():
  class IntWeight(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", lambda *_: jnp.ones((32, 8), jnp.int32))
      return jnp.dot(x, w)

  q8_model = qwix.quantize_model(IntWeight(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  with pytest.raises(TypeError, match="weight 'w' has dtype int32"):
    q8_model.init(jax.random.key(0), jnp.ones((1, 32), jnp.int32))


def test_weight_shape_mismatch(linen_setup):
  model, q8_model, _, _, x = linen_setup
  params = model.init(jax.random.key(0), x)["params"]
  params["up"]["kernel"] = params["up"]["kernel"][:, :48]
  abstract = jax.eval_shape(q8_model.init, jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match=r"up/kernel: weight of shape \(64, 48\) does not match"):
    q8rules.quantize_params(params, abstract)


def test_activation_shape_and_dtype_errors(linen_setup):
  _, q8_model, _, q8_vars, _ = linen_setup
  with pytest.raises(ValueError, match=r"up/dot_general0.*\(2, 3, 48\)"):
    q8_model.apply(q8_vars, jnp.ones((2, 3, 48)))
  # Flax layers promote x to the params' dtype; a raw jnp.dot does not
  custom = qwix.quantize_model(Custom(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  variables = custom.init(jax.random.key(0), jnp.ones((2, 32)))
  with pytest.raises(TypeError, match="dot_general0.*activations must be float.*int32"):
    custom.apply(variables, jnp.ones((2, 32), jnp.int32))


def test_float_params_fed_to_q8_model(linen_setup):
  model, q8_model, _, _, x = linen_setup
  float_vars = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="unquantized param to a quantized model"):
    q8_model.apply(float_vars, x)


def test_unsupported_product_stays_float_with_warning(rng):
  class SummedWeight(nn.Module):
    @nn.compact
    def __call__(self, x):  # the weight's free axis is summed away: no (K, N) product
      w = self.param("w", nn.initializers.normal(), (32, 8))
      return jnp.einsum("bk,kn->b", x, w)

  x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    variables = qwix.quantize_model(SummedWeight(), provider).init(jax.random.key(0), x)
  assert any("left float" in str(w.message) for w in caught)
  assert isinstance(variables["params"]["w"], jax.Array)
  assert provider.report().ops[0].path == "float"


# ---- dispatch to the Pallas fold ------------------------------------------------


@pytest.mark.slow
def test_provider_dispatches_decode_products_to_the_fold(rng):
  """A rule asking for the fold runs it (interpret mode on CPU) and the report says so."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(128, use_bias=False, name="up")(x)  # K = 1024
      return nn.DenseGeneral((2, 20), use_bias=False, name="heads")(h)  # N = 40: padded tile

  x = jnp.asarray(rng.standard_normal((1, 3, 1024)), jnp.float32)  # M = 3 rows
  provider = q8rules.Q8Provider([q8rules.Q8Rule(implementation="fold")])
  q8_model = qwix.quantize_model(Block(), provider)
  variables = q8_model.init(jax.random.key(0), x)
  y = jax.jit(q8_model.apply)(variables, x)
  p = variables["params"]
  ref = np.einsum(
    "btk,knh->btnh",
    np.asarray(x, np.float64) @ dequantized_f64(p["up"]["kernel"]),
    dequantized_f64(p["heads"]["kernel"]),
  )
  assert rel_err(y, ref) <= 1e-6
  assert provider.report().paths() == {"up/dot_general0": "fold", "heads/dot_general0": "fold"}
  # a prefill-sized product is refused by the fold, naming the op and why
  rows = q8rules.kernels.matmul.fold.TILE_ROWS[q8rules.kernels.matmul.fold.kernel_form()]
  with pytest.raises(ValueError, match=rf"up/dot_general0.*m=64 > {rows} tile rows"):
    q8_model.apply(variables, jnp.ones((1, 64, 1024)))
  # implementation=None picks per backend and shape (on CPU never the fold: interpret mode)
  default = q8rules.Q8Provider([q8rules.Q8Rule()])
  qwix.quantize_model(Block(), default).apply(variables, x)
  assert_default_paths(default.report())
