"""The decoder's attention sinks, output-projection bias and YaRN rope (gpt-oss's attention)
against a float64 numpy forward on random params (tests/gpt_oss_numpy_forward.py's attention,
written from OpenAI's reference and llama.cpp's readings), in one pass and decoded token by
token through the KV cache; YaRN's frequencies and magnitude against float64."""

from __future__ import annotations

import math
from operator import itemgetter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from q8rules import Q8Provider
from q8rules.models import Transformer, TransformerConfig, init_cache
from q8rules.models.attention import rope_angles, rope_mscale
from tests._utils import matrix
from tests.gpt_oss_numpy_forward import attention, yarn_inv_freq

CONFIG = TransformerConfig(
  arch="gpt-oss",
  vocab=64,
  dim=32,
  layers=2,
  heads=4,
  kv_heads=2,
  head_dim=8,
  ffn=32,
  rope_base=150000.0,
  rope_style="halves",
  rope_scaling="yarn",
  rope_factor=32.0,
  rope_original_context=4096,
  rope_base_local=150000.0,
  rope_factor_local=32.0,
  context_length=131072,
  qkv_bias=True,
  attn_output_bias=True,
  attn_sinks=True,
  sliding_window=4,
  local_layers=(True, False),
)
T = 11  # past the window: the local layer's ring wraps while decoding


def rel(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_params(config: TransformerConfig, seed: int) -> dict:
  """The model's params, every leaf random (biases and sinks too, which init as zeros)."""
  model = Transformer(config)
  tokens = jnp.zeros((1, 2), jnp.int32)
  params = model.init(jax.random.key(seed), tokens, init_cache(config, 8))["params"]
  rng = np.random.default_rng(seed)

  def draw(path: tuple, leaf: jax.Array) -> jax.Array:
    matrix = jax.tree_util.keystr(path).endswith(("['kernel']", "['table']"))
    scale = 1.0 / math.sqrt(leaf.shape[-2]) if matrix else 0.5
    return jnp.asarray(rng.standard_normal(leaf.shape) * scale, jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, params)


def float64_logits(config: TransformerConfig, params: dict, ids: np.ndarray) -> np.ndarray:
  """The reference: GGUF-named float64 weights of `params` through gpt_oss_numpy_forward's
  attention (sinks, biases, YaRN, window on layer 0) and a SwiGLU FFN."""
  p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  c = config
  hp = dict(
    heads=c.heads,
    kv_heads=c.kv_heads,
    head_dim=c.head_dim,
    base=c.rope_base,
    factor=c.rope_factor,
    orig_ctx=c.rope_original_context,
    window=c.sliding_window,
  )

  def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.norm_eps) * w

  x = p64["embed"]["table"].T[ids]
  for i in range(c.layers):
    layer = p64[f"layers_{i}"] if not c.scan_layers else jax.tree.map(itemgetter(i), p64["layers"])
    a = layer["attn"]
    w = {f"attn_{n}.weight": a[n]["kernel"].T for n in ("q", "k", "v")}
    w |= {f"attn_{n}.bias": a[n]["bias"] for n in ("q", "k", "v")}
    w |= {"attn_output.weight": a["o"]["kernel"].T, "attn_output.bias": a["o"]["bias"]}
    w["attn_sinks.weight"] = a["sinks"]
    x = x + attention(hp, w, "", rms(x, layer["attn_norm"]["scale"]), c.local_layers[i])
    h = rms(x, layer["mlp_norm"]["scale"])
    m = {n: layer["mlp"][n]["kernel"] for n in ("gate", "up", "down")}
    g = h @ m["gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ m["up"])) @ m["down"]
  return rms(x, p64["norm"]["scale"]) @ p64["lm_head"]["kernel"]


@pytest.mark.parametrize("served", matrix([False, True], True), ids=["flax", "provider"])
@pytest.mark.parametrize("scan", matrix([True, False], False), ids=["scan", "unrolled"])
def test_sinks_biases_yarn_match_float64(rng, scan, served):
  """One pass, then the same tokens decoded one at a time through the cache (the sinks on the
  one-token path, the local ring wrapped): within float32 rounding of float64. Under a q8rules
  provider the one-token attention is op 'decode_attention' (the native kernel, sinks
  included, where it runs)."""
  config = TransformerConfig(**{**CONFIG.__dict__, "scan_layers": scan})
  params = random_params(config, 0)
  ids = rng.integers(0, config.vocab, T)
  want = float64_logits(config, params, ids)
  model = Transformer(config)
  apply = jax.jit(qwix.quantize_model(model, Q8Provider([])).apply if served else model.apply)
  tokens = jnp.asarray(ids, jnp.int32)[None]
  whole, _ = apply({"params": params}, tokens, init_cache(config, 16), 0)
  assert rel(whole[0], want) < 1e-5
  cache, steps = init_cache(config, 16), []
  for p in range(T):
    out, cache = apply({"params": params}, tokens[:, p : p + 1], cache, p)
    steps.append(out[0, 0])
  assert rel(np.stack(steps), want) < 1e-5


@pytest.mark.slow
def test_sinks_change_the_output(rng):
  """Sinks of zero still take a share of each softmax: not the model without sinks (whose
  params are the same but for them)."""
  params = random_params(CONFIG, 1)
  ids = jnp.asarray(rng.integers(0, CONFIG.vocab, (1, 6)), jnp.int32)
  no_sinks = TransformerConfig(**{**CONFIG.__dict__, "attn_sinks": False})
  zeroed = jax.tree_util.tree_map_with_path(
    lambda path, a: a * 0 if "sinks" in jax.tree_util.keystr(path) else a, params
  )
  without = {k: v for k, v in params["layers"]["attn"].items() if k != "sinks"}
  base = {**params, "layers": {**params["layers"], "attn": without}}
  got, _ = Transformer(CONFIG).apply({"params": zeroed}, ids, init_cache(CONFIG, 8))
  plain, _ = Transformer(no_sinks).apply({"params": base}, ids, init_cache(no_sinks, 8))
  assert rel(got, plain) > 1e-3


@pytest.mark.parametrize(
  ("head_dim", "base", "factor", "orig"),
  [(16, 150000.0, 32.0, 4096), (64, 150000.0, 32.0, 4096), (128, 1e6, 4.0, 32768)],
)
def test_yarn_frequencies_and_mscale(head_dim, base, factor, orig):
  """The angles of every pair at positions 0..4095 and cos / sin's factor, against float64
  (llama.cpp's rounded correction dims, beta fast 32 / slow 1)."""
  config = TransformerConfig(
    heads=1,
    kv_heads=1,
    head_dim=head_dim,
    rope_base=base,
    rope_scaling="yarn",
    rope_factor=factor,
    rope_original_context=orig,
  )
  positions = np.arange(4096)
  got = np.asarray(rope_angles(config, jnp.asarray(positions), None))
  want = positions[:, None] * yarn_inv_freq(head_dim, base, factor, orig)[None]
  assert np.abs(got - want).max() <= 2e-6 * 4096
  low, high = want[-1, -1] / 4095 / (base ** (-(head_dim - 2) / head_dim)), want[-1, 0] / 4095
  assert math.isclose(low, 1 / factor) and math.isclose(high, 1.0)  # interpolated, as trained
  assert math.isclose(rope_mscale(config), 1 + 0.1 * math.log(factor), rel_tol=1e-6)
  plain = TransformerConfig(heads=1, kv_heads=1, head_dim=head_dim, rope_attn_factor=0.75)
  assert rope_mscale(plain) == 0.75


def test_yarn_needs_the_original_context():
  with pytest.raises(ValueError, match="rope_scaling 'yarn' needs rope_original_context > 0"):
    TransformerConfig(rope_scaling="yarn", rope_factor=32.0)
