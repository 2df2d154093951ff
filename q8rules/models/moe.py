"""The mixture-of-experts FFN, llama.cpp's `build_moe_ffn` (src/llama-graph.cpp) in plain Flax.

Per token x (dim,), with E experts, k of them used (`TransformerConfig.experts`,
`experts_used`):

  logits = x @ gate_inp (+ gate_inp_bias)                    (E,) float32: the router
  probs  = softmax(logits) | sigmoid(logits) | logits | sqrt(softplus(logits))
                                                             (`expert_gating`)
  chosen = top_k(probs (+ exp_probs_b), k)                   the bias only chooses
  w      = probs[chosen]; softmax(w) ('softmax_weight'); w / max(sum(w), 2^-14)
           (`expert_weights_norm`); w * scale (`expert_weights_scale`, unless 0 or 1)
  out    = sum_j w_j * down_e(act(gate_e(x)) * up_e(x)), e = chosen_j
           (`expert_weights_before_ffn`: x * w_j goes into expert j instead)
  out   += shared experts' FFN (times sigmoid(x @ gate_inp_shexp) with `shared_expert_gate`)

The router stays a float param (`gate_inp/kernel`, which `q8rules.rules.KEEP_FLOAT` keeps float
as llama.cpp's quantizer keeps `ffn_gate_inp`), computed in float32. The experts are 3-D params
in kernel layout, (E, K, N): `gate_exps` (E, dim, F), `up_exps` (E, dim, F), `down_exps`
(E, F, dim) (`gate_up_exps` (E, dim, 2F), gate columns then up, with `expert_fused_gate_up`),
and run through `jax.lax.ragged_dot` on the (token, slot) pairs sorted by expert, so under a
q8rules provider each is a stack of Q8_0 matrices served by op 'ragged_matmul' (a decode step
reads only the routed experts). Shapes: x (B, T, dim) in `dtype` -> (B, T, dim) in `dtype`.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from q8rules.models.config import TransformerConfig
from q8rules.models.per_layer import rms_normalize

WEIGHT_SUM_FLOOR = 6.103515625e-5
"""llama.cpp clamps the sum of the chosen weights from below by float16's smallest normal
before it divides by it (`norm_w`)."""


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
"""gpt-oss's clamped SwiGLU (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE, ggml's swiglu_oai)."""


def gated(config: TransformerConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
  """act(gate) * up, act the config's `activation`: SiLU (SwiGLU) or GELU-tanh (GeGLU); or
  'swiglu_oai': g * sigmoid(1.702 g) * (u + 1) with g = min(gate, 7), u = clip(up, -7, 7), in
  float32 (ggml's swiglu_oai). Shapes (..., F) -> (..., F) in gate's dtype."""
  if config.activation == "swiglu_oai":
    g = jnp.minimum(gate.astype(jnp.float32), SWIGLU_OAI_LIMIT)
    u = jnp.clip(up.astype(jnp.float32), -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (g * jax.nn.sigmoid(SWIGLU_OAI_ALPHA * g) * (u + 1.0)).astype(gate.dtype)
  if config.activation == "silu":
    return nn.silu(gate) * up
  return nn.gelu(gate, approximate=True) * up


def gating(config: TransformerConfig, logits: jax.Array) -> jax.Array:
  """The router's probabilities (M, E) float32 from its logits (M, E), per `expert_gating`."""
  if config.expert_gating == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if config.expert_gating == "sigmoid":
    return jax.nn.sigmoid(logits)
  if config.expert_gating == "sqrt_softplus":
    return jnp.sqrt(jax.nn.softplus(logits))
  return logits  # 'softmax_weight': the softmax runs over the chosen k


def route(
  config: TransformerConfig, logits: jax.Array, probs_bias: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """llama.cpp's routing: router logits (M, E) float32 -> (experts (M, k) int32 in descending
  order of their selection score, weights (M, k) float32)."""
  probs = gating(config, logits)
  selection = probs if probs_bias is None else probs + probs_bias
  _, chosen = jax.lax.top_k(selection, config.experts_used)
  weights = jnp.take_along_axis(probs, chosen, axis=-1)
  if config.expert_gating == "softmax_weight":
    weights = jax.nn.softmax(weights, axis=-1)
  if config.expert_weights_norm:
    total = jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), WEIGHT_SUM_FLOOR)
    weights = weights / total
  if config.expert_weights_scale not in (0.0, 1.0):
    weights = weights * jnp.float32(config.expert_weights_scale)
  return chosen.astype(jnp.int32), weights


def sort_by_expert(chosen: jax.Array, experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The (token, slot) pairs of `chosen` (M, k) sorted by expert: (order (M*k,) int32, the pairs'
  flat indices in that order; inverse (M*k,) int32, each pair's place in it; group_sizes (E,)
  int32, pairs per expert). The sort is stable: a expert's rows keep token order."""
  flat = chosen.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)
  group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
  return order, inverse, group_sizes


def gather_rows(a: jax.Array, index: jax.Array) -> jax.Array:
  """Rows `index` (R,) of activations `a` (M, n) -> (R, n): a gather, which q8rules' providers
  do not take for a table lookup (as they take `jnp.take` and `a[index]` of an array derived
  from a param: here, of a norm's scale)."""
  return jnp.take_along_axis(a, index[:, None], axis=0)


def sum_slots(per_slot: jax.Array) -> jax.Array:
  """The k slots' outputs (M, k, dim) added in slot order, ((s0 + s1) + s2) + ..., as ggml adds
  its experts' views: (M, dim). Not `jnp.sum(axis=1)`: XLA:CPU reduces a middle axis an
  element at a time, 70 us for (1, 8, 2048) where the unrolled adds take 0.7 us (a decode step
  of the Qwen3-30B-A3B-shaped file spent 0.65 of 24 ms there)."""
  out = per_slot[:, 0]
  for slot in range(1, per_slot.shape[1]):
    out = out + per_slot[:, slot]
  return out


class Moe(nn.Module):
  """The routed experts (and shared experts) of one layer: x (B, T, dim) -> (B, T, dim).

  `__call__(x, logits=None, router_x=None)`: `logits` (B, T, E) are the router's, computed by
  the caller; None: `gate_inp` of x here, or of `router_x` (B, T, dim) when given (with
  `expert_router_norm`, of rms_norm(router_x) / sqrt(dim) * `gate_inp_scale`: Gemma 4's).
  With `expert_down_scale` each expert's output is times its `down_exps_scale` (E,).
  """

  config: TransformerConfig

  def _experts(self, name: str, k: int, n: int, dtype: Any) -> jax.Array:
    init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
    w = self.param(name, init, (self.config.experts, k, n), jnp.float32)
    return w.astype(dtype)

  def _bias(self, name: str, n: int, expert: jax.Array) -> jax.Array:
    """Each sorted row's expert's bias (M*k, n) float32. The param `name` is (n, E): GGUF's
    `ffn_*_exps.bias` [E, n] in kernel layout (the last two axes of every tensor of two or more
    swapped, as q8rules.checkpoint.gguf loads and saves them); float as llama.cpp keeps
    biases: a gather, not a table lookup that a provider would serve as Q8_0."""
    b = self.param(name, nn.initializers.zeros, (n, self.config.experts), jnp.float32)
    return jnp.take_along_axis(b, expert[None, :], axis=1).T

  def _grouped(
    self, name: str, rows: jax.Array, n: int, group_sizes: jax.Array, expert: jax.Array
  ) -> jax.Array:
    """`rows` (R, K) sorted by expert times expert stack `name` (E, K, n), + its bias."""
    w = self._experts(name, rows.shape[-1], n, rows.dtype)
    y = jax.lax.ragged_dot(rows, w, group_sizes)
    if self.config.expert_bias:
      y = (y.astype(jnp.float32) + self._bias(f"{name}_bias", n, expert)).astype(rows.dtype)
    return y

  @nn.compact
  def __call__(
    self, x: jax.Array, logits: jax.Array | None = None, router_x: jax.Array | None = None
  ) -> jax.Array:
    c = self.config
    b, t, dim = x.shape
    k, f = c.experts_used, c.expert_ffn or c.ffn
    x2 = x.reshape(b * t, dim)
    if logits is None:
      router = nn.Dense(
        c.experts, use_bias=c.expert_router_bias, dtype=jnp.float32, name="gate_inp"
      )
      logits = router(self._router_input(x2 if router_x is None else router_x.reshape(x2.shape)))
    logits = logits.reshape(b * t, c.experts).astype(jnp.float32)
    probs_bias = None
    if c.expert_probs_bias:
      probs_bias = self.param("exp_probs_b", nn.initializers.zeros, (c.experts,), jnp.float32)
    chosen, weights = route(c, logits, probs_bias)
    if c.expert_down_scale:
      scale = self.param("down_exps_scale", nn.initializers.ones, (c.experts,), jnp.float32)
      weights = weights * jnp.take_along_axis(scale[None, :], chosen, axis=1)
    order, inverse, group_sizes = sort_by_expert(chosen, c.experts)
    token = order // k
    expert = jnp.take_along_axis(chosen.reshape(-1), order, axis=0)
    rows = gather_rows(x2, token)
    if c.expert_weights_before_ffn:
      w_rows = jnp.take_along_axis(weights.reshape(-1), order, axis=0)[:, None]
      rows = (rows.astype(jnp.float32) * w_rows).astype(c.dtype)
    if c.expert_fused_gate_up:
      gate, up = jnp.split(self._grouped("gate_up_exps", rows, 2 * f, group_sizes, expert), 2, -1)
    else:
      gate = self._grouped("gate_exps", rows, f, group_sizes, expert)
      up = self._grouped("up_exps", rows, f, group_sizes, expert)
    down = self._grouped("down_exps", gated(c, gate, up), dim, group_sizes, expert)
    per_slot = gather_rows(down, inverse).reshape(b * t, k, dim).astype(jnp.float32)
    if not c.expert_weights_before_ffn:
      per_slot = per_slot * weights[..., None]
    out = sum_slots(per_slot)
    if c.shared_expert_ffn:
      out = out + self._shared(x2)
    return out.reshape(b, t, dim).astype(c.dtype)

  def _router_input(self, x2: jax.Array) -> jax.Array:
    """What the router reads, (M, dim) float32: x2, or with `expert_router_norm` rms_norm(x2) /
    sqrt(dim) * `gate_inp_scale` (dim,)."""
    c = self.config
    if not c.expert_router_norm:
      return x2.astype(jnp.float32)
    scale = self.param("gate_inp_scale", nn.initializers.ones, (c.dim,), jnp.float32)
    return rms_normalize(x2, c.norm_eps) * jnp.float32(1.0 / math.sqrt(c.dim)) * scale

  def _shared(self, x2: jax.Array) -> jax.Array:
    """The shared experts' FFN of x2 (M, dim) -> (M, dim) float32, gated by sigmoid(x2 @
    gate_inp_shexp) with `shared_expert_gate`."""
    c = self.config
    dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=c.dtype, name=name)  # noqa: E731
    gate, up = (
      dense(c.shared_expert_ffn, "gate_shexp")(x2),
      dense(c.shared_expert_ffn, "up_shexp")(x2),
    )
    y = dense(c.dim, "down_shexp")(gated(c, gate, up))
    y = y.astype(jnp.float32)
    if c.shared_expert_gate:
      g = nn.Dense(1, use_bias=False, dtype=jnp.float32, name="gate_inp_shexp")
      y = y * jax.nn.sigmoid(g(x2.astype(jnp.float32)))
    return y


__all__ = [
  "SWIGLU_OAI_ALPHA",
  "SWIGLU_OAI_LIMIT",
  "WEIGHT_SUM_FLOOR",
  "Moe",
  "gather_rows",
  "gated",
  "gating",
  "route",
  "sort_by_expert",
]
