"""A test network: a small Llama-style decoder whose weights are N-D (einsum-style).

Nothing here knows about quantization: it is the kind of model a user hands to
`qwix.quantize_model`, written with the layers that give multi-axis weights
(`q8rules.models.Transformer` uses `nn.Dense` only). Its products:

  q, k, v   nn.DenseGeneral   'BTD,DNH->BTNH'   (a weight (D, N, H))
  o         nn.Einsum         'BTNH,NHD->BTD'   (two contraction axes)
  mlp       nn.Dense          gate, up (D, F), down (F, D)  (SwiGLU)
  lm_head   nn.Dense          (D, V)
  attention scores and values: einsums of two activations (no weight).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

Cache = tuple[tuple[jax.Array, jax.Array], ...]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  vocab: int = 2048
  dim: int = 512
  layers: int = 4
  heads: int = 8
  head_dim: int = 64
  ffn: int = 1408
  max_len: int = 64
  dtype: jnp.dtype = jnp.float32


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary embedding of x (B, T, N, H) at integer positions (T,)."""
  half = x.shape[-1] // 2
  freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[:, None].astype(jnp.float32) * freq  # (T, half)
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


class Attention(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x, cache_k, cache_v, pos):
    c = self.config
    proj = lambda name: nn.DenseGeneral(  # noqa: E731
      (c.heads, c.head_dim), use_bias=False, dtype=c.dtype, name=name
    )
    t = x.shape[1]
    positions = pos + jnp.arange(t)
    q = rope(proj("q")(x), positions)
    k = rope(proj("k")(x), positions)
    v = proj("v")(x)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
    scores = jnp.einsum("btnh,bsnh->bnts", q, cache_k) / jnp.sqrt(c.head_dim).astype(c.dtype)
    visible = jnp.arange(c.max_len)[None, :] <= positions[:, None]  # (T, S)
    scores = jnp.where(visible[None, None], scores.astype(jnp.float32), -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
    out = jnp.einsum("bnts,bsnh->btnh", probs, cache_v)
    o = nn.Einsum(
      (c.heads, c.head_dim, c.dim), "btnh,nhd->btd", use_bias=False, dtype=c.dtype, name="o"
    )
    return o(out), cache_k, cache_v


class Mlp(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    gate = nn.Dense(c.ffn, use_bias=False, dtype=c.dtype, name="gate")(x)
    up = nn.Dense(c.ffn, use_bias=False, dtype=c.dtype, name="up")(x)
    return nn.Dense(c.dim, use_bias=False, dtype=c.dtype, name="down")(nn.silu(gate) * up)


class Block(nn.Module):
  config: DecoderConfig

  @nn.compact
  def __call__(self, x, cache_k, cache_v, pos):
    h, cache_k, cache_v = Attention(self.config, name="attn")(
      nn.RMSNorm(dtype=self.config.dtype, name="attn_norm")(x), cache_k, cache_v, pos
    )
    x = x + h
    x = x + Mlp(self.config, name="mlp")(nn.RMSNorm(dtype=self.config.dtype, name="mlp_norm")(x))
    return x, cache_k, cache_v


class Decoder(nn.Module):
  """tokens (B, T) int32, cache, pos (int) -> logits (B, T, vocab) float32, new cache."""

  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, cache: Cache, pos: jax.Array | int = 0):
    c = self.config
    x = nn.Embed(c.vocab, c.dim, dtype=c.dtype, name="embed")(tokens)
    new_cache = []
    for i, (ck, cv) in enumerate(cache):
      x, ck, cv = Block(c, name=f"layers_{i}")(x, ck, cv, pos)
      new_cache.append((ck, cv))
    x = nn.RMSNorm(dtype=c.dtype, name="norm")(x)
    logits = nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="lm_head")(x)
    return logits.astype(jnp.float32), tuple(new_cache)


def init_cache(config: DecoderConfig, batch: int = 1) -> Cache:
  """An empty KV cache: per layer (k, v), each (batch, max_len, heads, head_dim)."""
  shape = (batch, config.max_len, config.heads, config.head_dim)
  return tuple(
    (jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype)) for _ in range(config.layers)
  )
