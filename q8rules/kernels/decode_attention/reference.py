"""The reference of one new token's attention: plain JAX, float32, every backend,
differentiable (what 'xla' runs when the caller brings no attention of its own)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from q8rules.attention_params import AttentionCall


def attend_one_token(call: AttentionCall) -> Array:
  """Softmax attention of `call.q` (B, 1, H, D) over positions [0, pos] of layer `slot` of
  keys / values (L, B, S, KV, D) (grouped-query: head h reads kv head h // (H / KV)); `pos` a
  scalar, or (B,): row b over [0, pos[b]]. Scores times `scale`, then
  `softcap * tanh(scores / softcap)` where `softcap`. `sinks` (H,) float32: head h's sink
  logit is one more term of its softmax, in the denominator only (ggml's soft_max with
  sinks); None: none. Returns (B, 1, H * D) float32."""
  q, slot, softcap, sinks = call.q, call.slot, call.softcap, call.sinks
  b, t, h, d = q.shape
  k = jax.lax.dynamic_index_in_dim(call.keys, slot, 0, keepdims=False).astype(jnp.float32)
  v = jax.lax.dynamic_index_in_dim(call.values, slot, 0, keepdims=False).astype(jnp.float32)
  kv = k.shape[2]
  qg = q.reshape(b, t, kv, h // kv, d).astype(jnp.float32)
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, k) * call.scale
  if softcap:
    scores = jnp.tanh(scores / softcap) * softcap
  visible = jnp.arange(k.shape[1]) <= jnp.reshape(call.pos, (-1, 1, 1, 1, 1))
  scores = jnp.where(visible, scores, -jnp.inf)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:
    sink = jnp.asarray(sinks, jnp.float32).reshape(1, kv, h // kv, 1, 1)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, h * d)


__all__ = ["attend_one_token"]
