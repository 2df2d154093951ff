"""llama.cpp's `build_moe_ffn` (src/llama-graph.cpp) in float64 numpy, written token by token and
slot by slot as the graph reads: the reference for `q8rules.models.moe.Moe`.

`moe64(config, params, x)`: x (M, dim) -> (M, dim) float64, `params` a dict of numpy arrays named
as the Flax module's (`gate_inp/kernel` (dim, E), `gate_exps` (E, dim, F), ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from q8rules.models.config import TransformerConfig

WEIGHT_SUM_FLOOR = 6.103515625e-5


def silu(x: np.ndarray) -> np.ndarray:
  return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def act(config: TransformerConfig, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
  return (silu(gate) if config.activation == "silu" else gelu_tanh(gate)) * up


def probabilities(config: TransformerConfig, logits: np.ndarray) -> np.ndarray:
  """The gating function of llama.cpp's `build_moe_ffn` on logits (E,)."""
  g = config.expert_gating
  if g == "softmax":
    return softmax(logits)
  if g == "sigmoid":
    return 1.0 / (1.0 + np.exp(-logits))
  if g == "sqrt_softplus":
    return np.sqrt(np.log1p(np.exp(logits)))
  return logits


def route64(
  config: TransformerConfig, logits: np.ndarray, probs_bias: np.ndarray | None
) -> tuple[list[int], np.ndarray]:
  """One token's chosen experts (best first) and their weights, from its router logits (E,)."""
  probs = probabilities(config, logits)
  selection = probs if probs_bias is None else probs + probs_bias
  chosen = [int(e) for e in np.argsort(-selection, kind="stable")[: config.experts_used]]
  w = probs[chosen]
  if config.expert_gating == "softmax_weight":
    w = softmax(w)
  if config.expert_weights_norm:
    w = w / max(w.sum(), WEIGHT_SUM_FLOOR)
  if config.expert_weights_scale not in (0.0, 1.0):
    w = w * config.expert_weights_scale
  return chosen, w


def moe64(
  config: TransformerConfig,
  params: Mapping[str, np.ndarray],
  x: np.ndarray,
  logits: np.ndarray | None = None,
) -> np.ndarray:
  """The experts' output for x (M, dim) float64 (router logits (M, E) given, or x @ gate_inp)."""
  c = config
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  f = c.expert_ffn or c.ffn
  if logits is None:
    logits = x @ p["gate_inp/kernel"] + (p["gate_inp/bias"] if c.expert_router_bias else 0.0)
  out = np.zeros_like(x)
  for m in range(x.shape[0]):
    chosen, w = route64(c, logits[m], p.get("exp_probs_b"))
    for j, e in enumerate(chosen):
      xin = x[m] * w[j] if c.expert_weights_before_ffn else x[m]

      def product(name: str, a: np.ndarray, e: int = e) -> np.ndarray:
        y = a @ p[name][e]
        return y + p[f"{name}_bias"][:, e] if c.expert_bias else y

      if c.expert_fused_gate_up:
        gate_up = product("gate_up_exps", xin)
        gate, up = gate_up[:f], gate_up[f:]
      else:
        gate, up = product("gate_exps", xin), product("up_exps", xin)
      y = product("down_exps", act(c, gate, up))
      out[m] += y if c.expert_weights_before_ffn else w[j] * y
  if c.shared_expert_ffn:
    h = act(c, x @ p["gate_shexp/kernel"], x @ p["up_shexp/kernel"]) @ p["down_shexp/kernel"]
    if c.shared_expert_gate:
      h = h / (1.0 + np.exp(-(x @ p["gate_inp_shexp/kernel"])))
    out += h
  return out
