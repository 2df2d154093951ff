"""The decoder's mixture of experts (`q8rules.models.moe.Moe`) against llama.cpp's `build_moe_ffn`
written in float64 numpy (tests/moe_numpy.py), float and served as Q8_0 (every expert stack a
Q8_0 param through the grouped product, the router float), in a scanned decoder read in place
and unrolled, prefill and a decode step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import q8rules
from q8rules.models import Transformer, TransformerConfig, init_cache
from q8rules.models.moe import Moe, route
from q8rules.providers.q8_weight import Q8Weight
from q8rules.q8_0 import BLOCK
from tests._utils import matrix, rel_err
from tests.moe_numpy import moe64, route64

pytestmark = pytest.mark.usefixtures("float32_matmuls")

BASE = TransformerConfig(
  vocab=96, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96, experts=8,
  experts_used=2, expert_ffn=64, expert_weights_norm=True,
)  # fmt: skip
"""Qwen 3 MoE's and Mixtral's routing: softmax, top 2 of 8, normalised weights."""

VARIANTS = {
  "softmax_norm": {},
  "softmax_top3_scaled": dict(experts_used=3, expert_weights_norm=False, expert_weights_scale=2.5),
  "sigmoid_probs_bias_shared": dict(
    expert_gating="sigmoid", expert_probs_bias=True, shared_expert_ffn=48
  ),
  "softmax_weight_biases": dict(
    expert_gating="softmax_weight", expert_weights_norm=False, expert_router_bias=True,
    expert_bias=True,
  ),
  "sqrt_softplus_before_ffn_gelu": dict(
    expert_gating="sqrt_softplus", expert_weights_before_ffn=True, activation="gelu_tanh"
  ),
  "fused_gate_up_shared_gate": dict(
    expert_fused_gate_up=True, shared_expert_ffn=32, shared_expert_gate=True
  ),
}  # fmt: skip


def block_params(config: TransformerConfig, seed: int) -> dict:
  """Random params of one `Moe` (biases and the probabilities' bias nonzero)."""
  x = jnp.zeros((1, 3, config.dim), jnp.float32)
  params = Moe(config).init(jax.random.key(seed), x)["params"]
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.3, jnp.float32), params
  )


def flat(params: dict) -> dict[str, np.ndarray]:
  """'a/b' -> array of a nested param dict (Q8_0 params dequantised in float64)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(
    params, is_leaf=lambda a: isinstance(a, Q8Weight)
  ):
    name = "/".join(str(p.key) for p in path)
    out[name] = experts64(leaf.array) if isinstance(leaf, Q8Weight) else np.asarray(leaf)
  return out


def experts64(w: q8rules.Q8Array) -> np.ndarray:
  """A served (E, K, N) stack, each expert blocked along its own K, in float64."""
  q = np.asarray(w.q, np.float64)
  d = np.repeat(np.asarray(w.scale, np.float64), BLOCK, axis=1)
  return q * d


@pytest.mark.parametrize("variant", matrix(sorted(VARIANTS), "sigmoid_probs_bias_shared"))
def test_block_is_llama_cpp_build_moe_ffn(variant):
  c = dataclasses.replace(BASE, **VARIANTS[variant])
  params = block_params(c, 1)
  x = np.random.default_rng(2).standard_normal((2, 9, c.dim))
  out = Moe(c).apply({"params": params}, jnp.asarray(x, jnp.float32))
  ref = moe64(c, flat(params), x.reshape(-1, c.dim)).reshape(x.shape)
  assert rel_err(out, ref) <= 2e-6, variant


def test_block_with_given_router_logits():
  """Router logits from the caller (Gemma 4 computes them from another input)."""
  c = BASE
  params = block_params(c, 3)
  params.pop("gate_inp")
  rng = np.random.default_rng(4)
  x, logits = rng.standard_normal((1, 7, c.dim)), rng.standard_normal((1, 7, c.experts))
  out = Moe(c).apply({"params": params}, jnp.asarray(x, jnp.float32), jnp.asarray(logits))
  ref = moe64(c, flat(params), x[0], logits[0])
  assert rel_err(out[0], ref) <= 2e-6


def test_routing_matches_llama_cpp_order_and_weights():
  c = dataclasses.replace(BASE, experts_used=3, expert_gating="sigmoid", expert_probs_bias=True)
  rng = np.random.default_rng(5)
  logits, bias = rng.standard_normal((11, c.experts)), rng.standard_normal(c.experts)
  chosen, w = route(c, jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32))
  for m in range(logits.shape[0]):
    want, w64 = route64(c, logits[m], bias)
    assert list(np.asarray(chosen[m])) == want
    assert rel_err(w[m], w64) <= 1e-6


@pytest.mark.parametrize("variant", ["softmax_norm", "softmax_weight_biases"])
def test_served_block_reads_q8_0_experts(variant):
  """Every expert stack becomes a Q8_0 param (E, K_pad, N) through the grouped product; the
  router stays float; the output is the float64 forward of those Q8_0 values."""
  c = dataclasses.replace(BASE, **VARIANTS[variant])
  params = block_params(c, 6)
  x = jnp.asarray(np.random.default_rng(7).standard_normal((1, 5, c.dim)), jnp.float32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  served = qwix.quantize_model(Moe(c), provider)
  abstract = jax.eval_shape(served.init, jax.random.key(0), x)["params"]
  q8 = q8rules.quantize_params(params, abstract)
  for name in ("gate_exps", "up_exps", "down_exps"):
    assert isinstance(q8[name], Q8Weight), name
    assert q8[name].array.q.dtype == jnp.int8 and q8[name].array.q.shape[0] == c.experts, name
  assert not isinstance(q8["gate_inp"]["kernel"], Q8Weight)
  out = served.apply({"params": q8}, x)
  ref = moe64(c, flat(q8), np.asarray(x[0], np.float64))
  assert rel_err(out[0], ref) <= 2e-6
  report = provider.report()
  grouped = [r for r in report.ops if r.op.startswith("ragged_dot")]
  assert len(grouped) == 3 and all(r.path == "cpu" for r in grouped), report
  left = {f.path for f in report.float_params}  # the router (biases are never listed)
  assert "gate_inp/kernel" in left and not left - {"gate_inp/kernel"} - {
    f"{name}_bias" for name in ("gate_exps", "up_exps", "down_exps")
  }, left


def decoder(config: TransformerConfig):
  """A decoder with random params (norm scales near 1), tokens (1, 14), and its cache."""
  model = Transformer(config)
  tokens = jnp.asarray(np.random.default_rng(8).integers(0, config.vocab, (1, 14)), jnp.int32)
  cache = init_cache(config, 32)
  params = model.init(jax.random.key(9), tokens, cache)["params"]
  return model, params, tokens, cache


def unstacked(params: dict) -> dict:
  """Float params stacked under 'layers' as an unrolled decoder's ('layers_0', ...)."""
  out = {k: v for k, v in params.items() if k != "layers"}
  layers = jax.tree.leaves(params["layers"])[0].shape[0]
  for i in range(layers):
    out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
  return out


@pytest.mark.slow
@pytest.mark.heavy
def test_decoder_scanned_in_place_served_and_decode_step():
  """A scanned Q8_0 decoder with experts: in place (each layer's experts read from the stack)
  equals unrolled, and a one-token decode step (grouped product, native CPU kernel) continues
  the prefill as the full sequence does."""
  model, params, tokens, cache = decoder(BASE)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  served = qwix.quantize_model(model, provider)
  abstract = jax.eval_shape(served.init, jax.random.key(0), tokens, cache)["params"]
  q8 = q8rules.quantize_params(params, abstract)
  assert q8["layers"]["moe"]["gate_exps"].array.q.shape == (2, 8, 64, 64)
  full, _ = served.apply({"params": q8}, tokens, cache)
  unrolled = qwix.quantize_model(
    Transformer(dataclasses.replace(BASE, scan_layers=False)),
    q8rules.Q8Provider([q8rules.Q8Rule()]),
  )
  abstract = jax.eval_shape(unrolled.init, jax.random.key(0), tokens, cache)["params"]
  per_layer = q8rules.quantize_params(unstacked(params), abstract)
  want, _ = unrolled.apply({"params": per_layer}, tokens, cache)
  assert rel_err(full, want) <= 1e-6
  step = jax.jit(lambda p, t, c, pos: served.apply({"params": p}, t, c, pos))
  _, filled = step(q8, tokens[:, :-1], cache, 0)
  last, _ = step(q8, tokens[:, -1:], filled, tokens.shape[1] - 1)
  assert rel_err(last[:, 0], full[:, -1]) <= 1e-5
  decode = [r for r in provider.report().ops if r.op.startswith("ragged_dot") and r.m == 2]
  assert decode and all(r.path == "cpu" for r in decode), provider.report()


@pytest.mark.slow
def test_float_decoder_scanned_equals_unrolled():
  model, params, tokens, cache = decoder(dataclasses.replace(BASE, expert_gating="sigmoid"))
  full, _ = model.apply({"params": params}, tokens, cache)
  unrolled = Transformer(dataclasses.replace(model.config, scan_layers=False))
  want, _ = unrolled.apply({"params": unstacked(params)}, tokens, cache)
  assert rel_err(full, want) <= 1e-6


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(experts=8, experts_used=9), "experts_used 9 must be in"),
    (dict(experts=8, experts_used=0), "experts_used 0 must be in"),
    (dict(experts_used=2), "experts_used 2 without experts"),
    (
      dict(experts=4, experts_used=2, expert_gating="tanh"),
      "expert_gating must be 'softmax', 'sigmoid', 'softmax_weight' or",
    ),
  ],
)
def test_config_refuses_bad_expert_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(**fields)
