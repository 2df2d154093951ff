"""gpt-oss (llama.cpp's openai-moe): its clamped SwiGLU and experts against float64
(tests/gpt_oss_numpy_forward.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.models import TransformerConfig
from q8rules.models.moe import Moe, gated
from tests.gpt_oss_numpy_forward import experts, swiglu_oai


def rel(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swiglu_oai(rng, dtype):
  """Against float64, gate and up over both sides of the clamp (|x| up to 12)."""
  gate = rng.uniform(-12, 12, (64, 96)).astype(np.float32)
  up = rng.uniform(-12, 12, (64, 96)).astype(np.float32)
  config = TransformerConfig(activation="swiglu_oai", dtype=dtype)
  got = gated(config, jnp.asarray(gate, dtype), jnp.asarray(up, dtype))
  assert got.dtype == dtype
  g64, u64 = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (gate, up))
  assert rel(got, swiglu_oai(g64, u64)) < (2e-7 if dtype == jnp.float32 else 8e-3)
  assert (gate > 7).any() and (up < -7).any() and (up > 7).any()


def test_unknown_activation_is_refused():
  with pytest.raises(ValueError, match="'silu', 'gelu_tanh' or 'swiglu_oai', got 'relu'"):
    TransformerConfig(activation="relu")


MOE = TransformerConfig(
  arch="gpt-oss",
  dim=64,
  ffn=32,
  experts=8,
  experts_used=4,
  expert_gating="softmax_weight",
  expert_router_bias=True,
  expert_bias=True,
  activation="swiglu_oai",
)


def test_experts_match_float64(rng):
  """gpt-oss's routing (top 4 of the router's logits with its bias, softmax over the 4), its
  per-expert biases and clamped SwiGLU: `Moe` against gpt_oss_numpy_forward's experts."""
  c = MOE
  x = jnp.asarray(rng.standard_normal((2, 5, c.dim)), jnp.float32)
  moe = Moe(c)
  params = moe.init(jax.random.key(0), x)["params"]

  def draw(path: tuple, leaf: jax.Array) -> jax.Array:
    fan_in = leaf.shape[-2] if leaf.ndim >= 2 else 1
    scale = 3.0 / math.sqrt(fan_in) if leaf.ndim >= 2 else 0.5
    return jnp.asarray(rng.standard_normal(leaf.shape) * scale, jnp.float32)

  params = jax.tree_util.tree_map_with_path(draw, params)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  w = {
    "ffn_gate_inp.weight": p["gate_inp"]["kernel"].T,
    "ffn_gate_inp.bias": p["gate_inp"]["bias"],
  }
  for name in ("gate", "up", "down"):
    w[f"ffn_{name}_exps.weight"] = p[f"{name}_exps"].transpose(0, 2, 1)
    w[f"ffn_{name}_exps.bias"] = p[f"{name}_exps_bias"].T  # (n, E): GGUF's [E, n] swapped
  got = moe.apply({"params": params}, x)
  h = np.asarray(x, np.float64).reshape(-1, c.dim)
  want = experts({"experts_used": c.experts_used}, w, "", h).reshape(x.shape)
  assert rel(got, want) < 1e-5
