"""`Q8LoraProvider`: LoRA adapters (float32 A (K, r), B (r, N)) on a frozen Q8_0 base, linen and
nnx, against the Q8_0-served model (B = 0: bit for bit) and float64 (outputs and gradients)."""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx

import q8rules
from tests._utils import rel_err, weight64, weights

K, N, RANK, ALPHA = 72, 40, 4, 6.0
"""The product's weight: K = 72 contracted (padded to 96 as Q8_0), N = 40 kept."""

X_SHAPE = (2, 3, K)


def _kernel_init(key, shape, dtype=jnp.float32):
  """`weights()` (magnitudes varying by row), the same every call."""
  del key
  return jnp.asarray(weights(np.random.default_rng(7), *shape), dtype)


class Layer(nn.Module):
  """One product (K, N): 'dense' (nn.Dense) or 'einsum' (btd,dhk->bthk, N = 4 x 10)."""

  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "dense":
      return nn.Dense(N, use_bias=False, kernel_init=_kernel_init, name="layer")(x)
    return nn.Einsum(
      (K, 4, 10), "btd,dhk->bthk", use_bias=False, kernel_init=_kernel_init, name="layer"
    )(x)


class NLayer(nnx.Module):
  """`Layer` in nnx (nnx.Linear / nnx.Einsum)."""

  def __init__(self, kind: str, rngs: nnx.Rngs):
    if kind == "dense":
      self.layer = nnx.Linear(K, N, use_bias=False, kernel_init=_kernel_init, rngs=rngs)
    else:
      self.layer = nnx.Einsum("btd,dhk->bthk", (K, 4, 10), kernel_init=_kernel_init, rngs=rngs)

  def __call__(self, x):
    return self.layer(x)


def _rule(**kw):
  return q8rules.Q8LoraRule(module_path="layer", rank=RANK, alpha=ALPHA, **kw)


def _value(v):
  return np.asarray(v[...] if isinstance(v, nnx.Variable) else v)


def _w64(kernel) -> np.ndarray:
  """The served weight in float64 as the (K, N) matrix."""
  q8 = kernel.array
  return weight64(_value(q8.q), _value(q8.scale))[:K]


def _reference(x, w64, a, b) -> np.ndarray:
  """float64 x @ W + x @ A @ B * alpha / rank, in the output shape (..., N) flattened."""
  x2d = np.asarray(x, np.float64).reshape(-1, K)
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return x2d @ w64 + x2d @ a @ b * (ALPHA / RANK)


def _grads64(x, a, b, c) -> tuple[np.ndarray, np.ndarray]:
  """float64 d/dA, d/dB of sum(y * c), y as `_reference`."""
  x2d = np.asarray(x, np.float64).reshape(-1, K)
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  c2d = np.asarray(c, np.float64).reshape(x2d.shape[0], N)
  s = ALPHA / RANK
  return s * x2d.T @ (c2d @ b.T), s * (x2d @ a).T @ c2d


def _linen(kind, rng, rule=None):
  x = jnp.asarray(rng.standard_normal(X_SHAPE), jnp.float32)
  provider = q8rules.Q8LoraProvider([rule or _rule()])
  model = qwix.quantize_model(Layer(kind), provider)
  params = model.init(jax.random.key(0), x)["params"]
  return model, params, x


def _random_ab(rng):
  a = jnp.asarray(rng.standard_normal((K, RANK)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((RANK, N)), jnp.float32)
  return a, b


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_linen_lora(kind, rng):
  """Params: the Q8 kernel and float32 kernel_lora_a (K, r), kernel_lora_b (r, N) (zeros);
  B = 0 is the Q8Provider's model bit for bit; random A, B against float64; grads of A, B."""
  model, params, x = _linen(kind, rng)
  layer = params["layer"]
  assert set(layer) == {"kernel", "kernel_lora_a", "kernel_lora_b"}
  assert layer["kernel"].array.q.dtype == jnp.int8
  assert layer["kernel_lora_a"].shape == (K, RANK) and layer["kernel_lora_a"].dtype == jnp.float32
  assert layer["kernel_lora_b"].shape == (RANK, N) and not np.any(layer["kernel_lora_b"])

  plain = qwix.quantize_model(Layer(kind), q8rules.Q8Provider([q8rules.Q8Rule()]))
  q8_params = plain.init(jax.random.key(0), x)
  served = plain.apply(q8_params, x)
  for run in (model.apply, jax.jit(model.apply)):
    assert np.array_equal(np.asarray(run({"params": params}, x)), np.asarray(served))

  a, b = _random_ab(rng)
  params = {"layer": {**layer, "kernel_lora_a": a, "kernel_lora_b": b}}
  y = jax.jit(model.apply)({"params": params}, x)
  w64 = _w64(layer["kernel"])
  err = rel_err(np.asarray(y).reshape(-1, N), _reference(x, w64, a, b))
  assert err < 1e-6, err

  c = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)

  def loss(ab):
    p = {"layer": {**layer, "kernel_lora_a": ab[0], "kernel_lora_b": ab[1]}}
    return jnp.sum(model.apply({"params": p}, x) * c)

  ga, gb = jax.jit(jax.grad(loss))((a, b))
  ga64, gb64 = _grads64(x, a, b, c)
  assert rel_err(ga, ga64) < 1e-5 and rel_err(gb, gb64) < 1e-5, (
    rel_err(ga, ga64),
    rel_err(gb, gb64),
  )


def _nnx(kind, rng, rule=None):
  x = jnp.asarray(rng.standard_normal(X_SHAPE), jnp.float32)
  provider = q8rules.Q8LoraProvider([rule or _rule()])
  model = qwix.apply_lora_to_model(NLayer(kind, nnx.Rngs(0)), provider, x, rngs=nnx.Rngs(1))
  return model, x


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_nnx_lora(kind, rng):
  """nnx.LoRAParam A (K, r) and B (r, N) beside the Q8 kernel; B = 0 bit-equal to the Q8Provider
  model; random A, B against float64; nnx.grad with DiffState(0, nnx.LoRAParam) against float64."""
  model, x = _nnx(kind, rng)
  lora = nnx.state(model, nnx.LoRAParam)
  assert set(lora["layer"]) == {"kernel_lora_a", "kernel_lora_b"}
  assert model.layer.kernel_lora_a.shape == (K, RANK)
  assert model.layer.kernel_lora_b.shape == (RANK, N)

  plain_provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  plain = qwix.quantize_model(NLayer(kind, nnx.Rngs(0)), plain_provider, x)
  assert np.array_equal(np.asarray(model(x)), np.asarray(plain(x)))

  a, b = _random_ab(rng)
  model.layer.kernel_lora_a.value = a
  model.layer.kernel_lora_b.value = b
  w64 = _w64(model.layer.kernel)
  err = rel_err(np.asarray(model(x)).reshape(-1, N), _reference(x, w64, a, b))
  assert err < 1e-6, err

  c = jnp.asarray(rng.standard_normal((*X_SHAPE[:2], N)), jnp.float32).reshape(model(x).shape)

  def loss(m, x, c):
    return jnp.sum(m(x) * c)

  grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model, x, c)
  ga64, gb64 = _grads64(x, a, b, c)
  ga, gb = _value(grads["layer"]["kernel_lora_a"]), _value(grads["layer"]["kernel_lora_b"])
  assert rel_err(ga, ga64) < 1e-5 and rel_err(gb, gb64) < 1e-5, (
    rel_err(ga, ga64),
    rel_err(gb, gb64),
  )


def _base_bytes(state) -> dict:
  flat = flax.traverse_util.flatten_dict(nnx.to_pure_dict(state))
  return {k: np.asarray(v).tobytes() for k, v in flat.items()}


def test_nnx_adam_step_trains_only_the_adapter(rng):
  """An optax.adam step (nnx.Optimizer wrt nnx.LoRAParam) moves A and B, lowers the loss and
  leaves every other state (the Q8 kernel's int8 values and scales) byte for byte."""
  model, x = _nnx("dense", rng)
  target = jnp.asarray(rng.standard_normal((*X_SHAPE[:2], N)), jnp.float32)
  base = _base_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
  assert any(np.asarray(v).dtype == np.int8 for v in jax.tree.leaves(nnx.state(model)))
  lora_before = _base_bytes(nnx.state(model, nnx.LoRAParam))

  def loss(m):
    return jnp.mean((m(x) - target) ** 2)

  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(m, opt):
    value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
    opt.update(m, grads)
    return value

  first = step(model, optimizer)
  for _ in range(3):
    last = step(model, optimizer)
  assert last < first
  assert _base_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam))) == base
  assert _base_bytes(nnx.state(model, nnx.LoRAParam)) != lora_before


def test_linen_adam_step_keeps_the_base(rng):
  """linen: adam on the lora leaves only (the int8 kernel is not differentiable); the loss falls
  and the Q8 kernel's bytes are those init made."""
  model, params, x = _linen("einsum", rng)
  target = jnp.asarray(rng.standard_normal((*X_SHAPE[:2], 4, 10)), jnp.float32)
  flat = flax.traverse_util.flatten_dict(params, is_leaf=lambda _, v: not isinstance(v, dict))
  lora = {k: v for k, v in flat.items() if k[-1].endswith(("_lora_a", "_lora_b"))}
  base = {k: v for k, v in flat.items() if k not in lora}
  base_bytes = [np.asarray(v).tobytes() for v in jax.tree.leaves(base)]

  def loss(lora):
    p = flax.traverse_util.unflatten_dict({**base, **lora})
    return jnp.mean((model.apply({"params": p}, x) - target) ** 2)

  tx = optax.adam(1e-2)
  state = tx.init(lora)
  first = loss(lora)
  for _ in range(3):
    grads = jax.jit(jax.grad(loss))(lora)
    updates, state = tx.update(grads, state)
    lora = optax.apply_updates(lora, updates)
  assert loss(lora) < first
  assert [np.asarray(v).tobytes() for v in jax.tree.leaves(base)] == base_bytes


class Two(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(K, use_bias=False, name="plain")(x)
    return nn.Dense(N, use_bias=False, name="adapted")(h)


def test_plain_rules_in_the_same_provider_get_no_adapter(rng):
  """A Q8Rule beside a Q8LoraRule: its product is Q8_0-served without an adapter."""
  x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
  rules = [
    q8rules.Q8Rule(module_path="plain"),
    q8rules.Q8LoraRule(module_path="adapted", rank=RANK, alpha=ALPHA),
  ]
  model = qwix.quantize_model(Two(), q8rules.Q8LoraProvider(rules))
  params = model.init(jax.random.key(0), x)["params"]
  assert set(params["plain"]) == {"kernel"}
  assert set(params["adapted"]) == {"kernel", "kernel_lora_a", "kernel_lora_b"}
  plain = qwix.quantize_model(Two(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  want = plain.apply(plain.init(jax.random.key(0), x), x)
  assert np.array_equal(np.asarray(model.apply({"params": params}, x)), np.asarray(want))


class TiedHead(nn.Module):
  """A lookup and a tied head on one (K, N) = (features, vocab) table, as in test_lookup."""

  @nn.compact
  def __call__(self, ids):
    table = self.param("embedding", nn.initializers.normal(1.0), (K, N), jnp.float32)
    x = jnp.moveaxis(jnp.take(table, ids, axis=1), 0, -1)  # (B, T, K)
    return jnp.dot(jnp.tanh(x), table)


def test_tied_head_adapter_along_k_and_n(rng):
  """The head `x @ table` (K = features, N = vocab) gets A (K, r), B (r, N) on the one Q8 table
  that the lookup also reads; against float64."""
  ids = jnp.asarray(rng.integers(0, N, (2, 5)), jnp.int32)
  provider = q8rules.Q8LoraProvider([q8rules.Q8LoraRule(rank=RANK, alpha=ALPHA)])
  model = qwix.quantize_model(TiedHead(), provider)
  params = model.init(jax.random.key(0), ids)["params"]
  assert set(params) == {"embedding", "embedding_lora_a", "embedding_lora_b"}
  assert params["embedding"].array.q.dtype == jnp.int8
  assert params["embedding_lora_a"].shape == (K, RANK)
  assert params["embedding_lora_b"].shape == (RANK, N)
  assert provider.report().paths()["/take0"] == "lookup"
  a, b = _random_ab(rng)
  y = model.apply({"params": {**params, "embedding_lora_a": a, "embedding_lora_b": b}}, ids)
  deq = _w64(params["embedding"])
  x = np.tanh(np.moveaxis(np.take(deq, np.asarray(ids), axis=1), 0, -1)).reshape(-1, K)
  err = rel_err(np.asarray(y).reshape(-1, N), _reference(x, deq, a, b))
  assert err < 1e-6, err


def test_dropout_draws_from_the_dropout_stream(rng):
  """dropout > 0: the delta changes with the 'dropout' key; the base product does not."""
  model, params, x = _linen("dense", rng, _rule(dropout=0.5))
  a, b = _random_ab(rng)
  p = {"params": {"layer": {**params["layer"], "kernel_lora_a": a, "kernel_lora_b": b}}}
  y1 = model.apply(p, x, rngs={"dropout": jax.random.key(1)})
  y2 = model.apply(p, x, rngs={"dropout": jax.random.key(2)})
  again = model.apply(p, x, rngs={"dropout": jax.random.key(1)})
  assert np.array_equal(np.asarray(y1), np.asarray(again))
  assert not np.allclose(y1, y2)
  zero_b = {"params": {"layer": {**params["layer"], "kernel_lora_a": a}}}
  no_drop, _, _ = _linen("dense", rng)
  want = no_drop.apply(zero_b, x)
  assert np.array_equal(
    np.asarray(model.apply(zero_b, x, rngs={"dropout": jax.random.key(1)})), np.asarray(want)
  )


def test_bad_rules_are_named(rng):
  with pytest.raises(ValueError, match=r"module_path='layer'.*alpha=0"):
    q8rules.Q8LoraRule(module_path="layer", rank=RANK, alpha=0)
  with pytest.raises(ValueError, match=r"alpha=-1"):
    q8rules.Q8LoraRule(module_path="layer", rank=RANK, alpha=-1.0)
  with pytest.raises(ValueError, match=r"rank=0"):
    q8rules.Q8LoraRule(module_path="layer", rank=0, alpha=1.0)
  with pytest.raises(ValueError, match=r"dropout=1"):
    q8rules.Q8LoraRule(module_path="layer", rank=1, alpha=1.0, dropout=1.0)
  with pytest.raises(
    ValueError, match=r"layer/dot_general0: LoRA rank 41 exceeds min\(K, N\) = 40"
  ):
    _linen("dense", rng, q8rules.Q8LoraRule(module_path="layer", rank=41, alpha=1.0))
  with pytest.raises(ValueError, match=r"layer/einsum0: LoRA rank 73 exceeds"):
    _nnx("einsum", rng, q8rules.Q8LoraRule(module_path="layer", rank=73, alpha=1.0))
  with pytest.raises(ValueError, match=r"module_path='decoder/.\*'"), pytest.warns(UserWarning):
    _linen("dense", rng, q8rules.Q8LoraRule(module_path="decoder/.*", rank=2, alpha=1.0))
  with pytest.raises(ValueError, match=r"module_path='head'"), pytest.warns(UserWarning):
    _nnx("dense", rng, q8rules.Q8LoraRule(module_path="head", rank=2, alpha=1.0))


class NTwo(nnx.Module):
  """Two adapted products in a row: A and B of the first get their gradient through the second
  product's frozen Q8_0 weight (its gradient in x, op 'matmul_t')."""

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(K, 64, use_bias=False, kernel_init=_kernel_init, rngs=rngs)
    self.down = nnx.Linear(64, N, use_bias=False, kernel_init=_kernel_init, rngs=rngs)

  def __call__(self, x):
    return self.down(self.up(x))


def test_nnx_grads_through_a_frozen_q8_layer(rng):
  """The keyword form of the provider (one rule); the grads of both layers' A and B against a
  float64 backward pass through the dequantised weights."""
  x = jnp.asarray(rng.standard_normal((5, K)), jnp.float32)
  provider = q8rules.Q8LoraProvider(rank=RANK, alpha=ALPHA)
  model = qwix.apply_lora_to_model(NTwo(nnx.Rngs(0)), provider, x, rngs=nnx.Rngs(1))
  s = ALPHA / RANK
  ab64 = {}
  for name, (k, n) in (("up", (K, 64)), ("down", (64, N))):
    layer = getattr(model, name)
    a = rng.standard_normal((k, RANK)).astype(np.float32)
    b = rng.standard_normal((RANK, n)).astype(np.float32) * 0.1
    layer.kernel_lora_a.value, layer.kernel_lora_b.value = jnp.asarray(a), jnp.asarray(b)
    w = weight64(_value(layer.kernel.array.q), _value(layer.kernel.array.scale))[:k]
    ab64[name] = (w, a.astype(np.float64), b.astype(np.float64))
  c = jnp.asarray(rng.standard_normal((5, N)), jnp.float32)
  grads = nnx.jit(
    nnx.grad(lambda m, x, c: jnp.sum(m(x) * c), argnums=nnx.DiffState(0, nnx.LoRAParam))
  )(model, x, c)

  (w1, a1, b1), (w2, a2, b2) = ab64["up"], ab64["down"]
  x64, dy = np.asarray(x, np.float64), np.asarray(c, np.float64)
  h = x64 @ w1 + x64 @ a1 @ b1 * s
  dh = dy @ (w2 + a2 @ b2 * s).T
  want = {
    ("up", "a"): s * x64.T @ (dh @ b1.T),
    ("up", "b"): s * (x64 @ a1).T @ dh,
    ("down", "a"): s * h.T @ (dy @ b2.T),
    ("down", "b"): s * (h @ a2).T @ dy,
  }
  for (name, which), ref in want.items():
    got = _value(grads[name][f"kernel_lora_{which}"])
    assert rel_err(got, ref) < 1e-5, (name, which, rel_err(got, ref))


def test_bfloat16_activations(rng):
  """bfloat16 x: B = 0 is the Q8Provider model bit for bit; random A, B within bfloat16's
  rounding of the output (the sum runs in float32, cast once) of float64's."""
  model, params, x = _linen("dense", rng)
  x = x.astype(jnp.bfloat16)
  plain = qwix.quantize_model(Layer("dense"), q8rules.Q8Provider([q8rules.Q8Rule()]))
  want = plain.apply(plain.init(jax.random.key(0), x), x)
  got = jax.jit(model.apply)({"params": params}, x)
  assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(want))
  a, b = _random_ab(rng)
  y = model.apply(
    {"params": {"layer": {**params["layer"], "kernel_lora_a": a, "kernel_lora_b": b}}}, x
  )
  ref = _reference(np.asarray(x, np.float32), _w64(params["layer"]["kernel"]), a, b)
  assert y.dtype == jnp.bfloat16 and rel_err(np.asarray(y, np.float32).reshape(-1, N), ref) < 4e-3
