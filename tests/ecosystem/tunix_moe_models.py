"""Small, randomly initialised Gemma 4 and Qwen 3 MoE models of Tunix (`tunix.models.gemma4`,
`tunix.models.qwen3`), as they ship: the real layer shapes at small sizes (two layers, every
contracted axis a multiple of 32), every param overwritten with fresh random values.

  gemma4-e2b    dense, per-layer inputs (`per_layer_model_projection` times a constant) and KV
                shared across layers, as Gemma 4 E2B/E4B
  gemma4-31b    dense, global layers with K = V and their own KV heads, as Gemma 4 31B
  gemma4-moe    experts through `jax.lax.ragged_dot` on a transposed, reshaped gating weight
                (`MoERagged`) beside a dense branch, as Gemma 4 26B-A4B
  qwen3-moe     experts as `gate_proj[i]` slices in a loop of einsums (Tunix's CPU path of
                `MoELayer`), as Qwen 3 30B-A3B
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.ecosystem.tunix_models import DIM, HEAD_DIM, HEADS, KV_HEADS, VOCAB

LAYERS = 2
LENGTH = 8
BATCH = 2
EXPERTS = 8
TOP_K = 2


@dataclasses.dataclass(frozen=True)
class Case:
  """One model: its name (see the module) and the params' dtype ('float32' or 'bfloat16')."""

  name: str
  dtype: str

  @property
  def id(self) -> str:
    return f"{self.name}-{self.dtype}"


CASES = tuple(
  Case(name, dtype)
  for name in ("gemma4-e2b", "gemma4-31b", "gemma4-moe", "qwen3-moe")
  for dtype in ("float32", "bfloat16")
)


def _gemma4(case: Case) -> nnx.Module:
  from tunix.models.gemma4 import model as g4

  dtype = jnp.dtype(case.dtype)
  local, glob = g4.AttentionType.LOCAL_SLIDING, g4.AttentionType.GLOBAL
  common = dict(
    num_layers=LAYERS,
    num_embed=VOCAB,
    embed_dim=DIM,
    hidden_dim=128,
    num_heads=HEADS,
    head_dim=HEAD_DIM,
    num_kv_heads=KV_HEADS,
    sliding_window_size=16,
    global_key_size=HEAD_DIM,
    attention_pattern=(local, glob),
    param_dtype=dtype,
    dtype=dtype,
  )
  if case.name == "gemma4-e2b":
    cfg = g4.ModelConfig(
      **common, per_layer_input_dim=32, frac_shared_layers=0.5, override_kv_shared_ffw_hidden=256
    )
  elif case.name == "gemma4-31b":
    cfg = g4.ModelConfig(**common, k_eq_v_global=True, num_global_kv_heads=1)
  else:
    cfg = g4.ModelConfig(
      **{**common, "hidden_dim": 128},
      enable_moe=True,
      num_experts=EXPERTS,
      expert_dim=64,
      num_experts_per_tok=TOP_K,
      moe_dense_hidden_dim=128,
      k_eq_v_global=True,
      num_global_kv_heads=1,
    )
  return g4.Gemma4(cfg, rngs=nnx.Rngs(0))


def _qwen3_moe(case: Case) -> nnx.Module:
  from tunix.models.qwen3 import model as q3

  dtype = jnp.dtype(case.dtype)
  cfg = q3.ModelConfig(
    num_layers=LAYERS,
    vocab_size=VOCAB,
    embed_dim=DIM,
    hidden_dim=128,
    num_heads=HEADS,
    head_dim=HEAD_DIM,
    num_kv_heads=KV_HEADS,
    rope_theta=10_000,
    norm_eps=1e-6,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    param_dtype=dtype,
    dtype=dtype,
  )
  return q3.Qwen3(cfg, rngs=nnx.Rngs(0))


def randomize(model: nnx.Module, rng: np.random.Generator) -> None:
  """Every param of `model` replaced by fresh random values (norm scales near 0, weights with
  a std of 1/sqrt(fan-in)), in its own dtype."""
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      shape, dtype = node[...].shape, node[...].dtype
      fan_in = shape[-2] if len(shape) >= 2 else 1
      values = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
      node[...] = jnp.asarray(values * (0.1 if len(shape) == 1 else 1.0), dtype)


def build(case: Case, seed: int = 0) -> nnx.Module:
  """The case's model with random params (the same for the same seed)."""
  model = _gemma4(case) if case.name.startswith("gemma4") else _qwen3_moe(case)
  randomize(model, np.random.default_rng(seed))
  return model


def inputs(seed: int = 0) -> tuple[Any, ...]:
  """(tokens (B, T) int32, positions (B, T), cache None, causal mask (B, T, T) bool)."""
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (BATCH, LENGTH)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (BATCH, LENGTH))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((LENGTH, LENGTH), bool)), (BATCH, LENGTH, LENGTH))
  return tokens, positions, None, mask


def logits(model: Any, args: tuple[Any, ...]) -> jax.Array:
  """The model's logits (B, T, V) in float32."""
  return jnp.asarray(model(*args)[0], jnp.float32)


def expert_params(model: nnx.Module) -> dict[str, Any]:
  """path -> value of every expert stack (a param of three or more axes whose first is the
  expert axis) of `model`."""
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param) and any(k in ("moe", "mlp") for k in map(str, path)):
      name = "/".join(map(str, path))
      if any(k in name for k in ("gating_einsum", "linear", "gate_proj", "up_proj", "down_proj")):
        value = node[...]
        if getattr(value, "ndim", len(getattr(value, "shape", ()))) >= 3:
          out[name] = value
  return out
