"""A decoder-only transformer in the shape of llama.cpp's `llama` and `qwen2` archs.

What `q8rules.llm.load_gguf` builds from a GGUF file, written as a plain Flax
linen module. Beyond the demo decoder (`q8rules.models.llama`) it has:

  * grouped-query attention: `kv_heads` key/value heads, each shared by
    `heads // kv_heads` query heads;
  * RoPE in llama.cpp's two conventions (`rope_style`):
      - 'interleaved' (ggml's NORM mode, arch `llama`): rotates the pairs
        (x[2i], x[2i+1]). llama.cpp's HF converter permutes the rows of
        attn_q / attn_k so that this mode equals HF's rotate-half on the
        original weights; using the same mode here means the file's rows are
        used as stored (no un-permutation, no copy);
      - 'halves' (ggml's NEOX mode, arch `qwen2`): rotates (x[i], x[i + H/2]);
    the angle of pair i at position p is `p * scale * base**(-2i/H) / f_i`
    (`scale` = 1 / linear factor, `f_i` from a `rope_freqs` table when the
    file has one, as Llama 3.1's);
  * biases on q, k, v (`qkv_bias`, qwen2);
  * an embedding table stored as GGUF stores `token_embd` read in kernel
    layout, (dim, vocab), which may be a `Q8Array`: a lookup dequantizes only
    the looked-up columns, and with tied embeddings the same table is the
    output projection (no second copy).

Products: q, k, v, o, gate, up, down and lm_head are `nn.Dense` (kernels
(in, out)), so `qwix.quantize_model` with `q8rules.Q8Rule`s serves them as
Q8_0; attention scores and values are products of activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from q8rules.kernels import q8_matmul
from q8rules.q8_0 import BLOCK, Q8Array

Cache = tuple[tuple[jax.Array, jax.Array], ...]
RopeStyle = Literal["interleaved", "halves"]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters, in llama.cpp's terms where it has them.

  Attributes:
    arch: 'llama' or 'qwen2' (GGUF `general.architecture`).
    vocab: tokens in the vocabulary (rows of `token_embd`).
    dim: embedding length.
    layers: blocks.
    heads: query heads.
    kv_heads: key/value heads (GQA: `heads % kv_heads == 0`).
    head_dim: per-head width (even).
    ffn: feed-forward width.
    rope_base: RoPE frequency base (theta).
    rope_style: 'interleaved' (llama.cpp NORM) or 'halves' (NEOX).
    rope_scaling: None or 'linear'.
    rope_factor: the linear scaling factor (positions are divided by it).
    rope_freq_factors: the model has a `rope_freqs` param (head_dim / 2,)
      dividing each pair's frequency.
    norm_eps: RMSNorm epsilon.
    context_length: the training context (informative; the cache sets the
      usable length).
    tied_embeddings: the output projection is the embedding table.
    qkv_bias: q, k and v have biases.
    dtype: activation dtype (float32 or bfloat16); softmax and norms run in
      float32, logits come back float32.
  """

  arch: str = "llama"
  vocab: int = 256
  dim: int = 64
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 16
  ffn: int = 128
  rope_base: float = 10000.0
  rope_style: RopeStyle = "interleaved"
  rope_scaling: str | None = None
  rope_factor: float = 1.0
  rope_freq_factors: bool = False
  norm_eps: float = 1e-5
  context_length: int = 2048
  tied_embeddings: bool = False
  qkv_bias: bool = False
  dtype: Any = jnp.float32


def rope_angles(config: TransformerConfig, positions: jax.Array, freq_factors: Any) -> jax.Array:
  """Angles (T, head_dim / 2) float32 for integer positions (T,), as llama.cpp's rope."""
  c = config
  half = c.head_dim // 2
  inv_freq = c.rope_base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / c.head_dim)
  if freq_factors is not None:
    inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
  scale = 1.0 / c.rope_factor if c.rope_scaling == "linear" else 1.0
  return positions.astype(jnp.float32)[:, None] * scale * inv_freq[None, :]


def apply_rope(x: jax.Array, angles: jax.Array, style: RopeStyle) -> jax.Array:
  """Rotate x (B, T, N, H) by angles (T, H / 2), in float32; returns x's dtype."""
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  xf = x.astype(jnp.float32)
  if style == "interleaved":
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)
  elif style == "halves":
    half = x.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  else:
    raise ValueError(f"rope_style must be 'interleaved' or 'halves', got {style!r}")
  return out.astype(x.dtype)


class RMSNorm(nn.Module):
  """llama.cpp's RMS norm: x * rsqrt(mean(x^2) + eps) * scale, computed in float32."""

  dim: int
  eps: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (self.dim,), jnp.float32)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * jnp.asarray(scale, jnp.float32)).astype(self.dtype)


class Embed(nn.Module):
  """Token embeddings, the table stored (dim, vocab): GGUF's `token_embd` in kernel layout.

  The `table` param is a float array (dim, vocab) or a `Q8Array` (q (dim,
  vocab) int8, scale (dim / 32, vocab), blocked along axis 0). `__call__`
  looks up token ids (B, T) -> (B, T, dim) in `dtype`, dequantizing only the
  looked-up columns; `attend` is x (B, T, dim) @ table -> (B, T, vocab)
  float32 (the Q8_0 kernels for a Q8Array).
  """

  vocab: int
  dim: int
  dtype: Any = jnp.float32

  def setup(self) -> None:
    self.table = self.param(
      "table", nn.initializers.normal(1.0), (self.dim, self.vocab), jnp.float32
    )

  def __call__(self, ids: jax.Array) -> jax.Array:
    t = self.table
    if isinstance(t, Q8Array):
      q = jnp.take(t.q, ids, axis=1).astype(jnp.float32)  # (dim, B, T)
      s = jnp.take(t.scale, ids, axis=1).astype(jnp.float32)  # (dim / 32, B, T)
      cols = (q.reshape(self.dim // BLOCK, BLOCK, *ids.shape) * s[:, None]).reshape(q.shape)
    else:
      cols = jnp.take(jnp.asarray(t), ids, axis=1).astype(jnp.float32)
    return jnp.moveaxis(cols, 0, -1).astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    t = self.table
    if isinstance(t, Q8Array):
      return q8_matmul(x, t, preferred_element_type=jnp.float32)
    return jnp.dot(x, jnp.asarray(t).astype(x.dtype), preferred_element_type=jnp.float32)


class Attention(nn.Module):
  """Causal GQA self-attention with RoPE over a KV cache (B, S, kv_heads, head_dim)."""

  config: TransformerConfig

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    pos: jax.Array | int,
    freq_factors: Any,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    c = self.config
    b, t, _ = x.shape
    dense = lambda n, name, bias: nn.Dense(n, use_bias=bias, dtype=c.dtype, name=name)  # noqa: E731
    q = dense(c.heads * c.head_dim, "q", c.qkv_bias)(x).reshape(b, t, c.heads, c.head_dim)
    k = dense(c.kv_heads * c.head_dim, "k", c.qkv_bias)(x).reshape(b, t, c.kv_heads, c.head_dim)
    v = dense(c.kv_heads * c.head_dim, "v", c.qkv_bias)(x).reshape(b, t, c.kv_heads, c.head_dim)
    positions = pos + jnp.arange(t)
    angles = rope_angles(c, positions, freq_factors)
    q = apply_rope(q, angles, c.rope_style)
    k = apply_rope(k, angles, c.rope_style)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
    group = c.heads // c.kv_heads
    qg = q.reshape(b, t, c.kv_heads, group, c.head_dim).astype(jnp.float32)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, cache_k.astype(jnp.float32))
    scores = scores * (1.0 / float(c.head_dim) ** 0.5)
    visible = jnp.arange(cache_k.shape[1])[None, :] <= positions[:, None]  # (T, S)
    scores = jnp.where(visible[None, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, cache_v.astype(jnp.float32))
    out = out.reshape(b, t, c.heads * c.head_dim).astype(c.dtype)
    return dense(c.dim, "o", False)(out), cache_k, cache_v


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    gate = nn.Dense(c.ffn, use_bias=False, dtype=c.dtype, name="gate")(x)
    up = nn.Dense(c.ffn, use_bias=False, dtype=c.dtype, name="up")(x)
    return nn.Dense(c.dim, use_bias=False, dtype=c.dtype, name="down")(nn.silu(gate) * up)


class Block(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, cache_k, cache_v, pos, freq_factors):
    c = self.config
    h, cache_k, cache_v = Attention(c, name="attn")(
      RMSNorm(c.dim, c.norm_eps, c.dtype, name="attn_norm")(x), cache_k, cache_v, pos, freq_factors
    )
    x = x + h
    x = x + Mlp(c, name="mlp")(RMSNorm(c.dim, c.norm_eps, c.dtype, name="mlp_norm")(x))
    return x, cache_k, cache_v


class Transformer(nn.Module):
  """tokens (B, T) int32, cache, pos -> logits (B, T, vocab) float32, new cache.

  `pos` is the position of tokens[:, 0]; the cache holds positions [0, pos)
  already and gets [pos, pos + T) written.
  """

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, tokens: jax.Array, cache: Cache, pos: jax.Array | int = 0
  ) -> tuple[jax.Array, Cache]:
    c = self.config
    if c.heads % c.kv_heads or c.head_dim % 2:
      raise ValueError(f"heads {c.heads} not a multiple of kv_heads {c.kv_heads}, or odd head_dim")
    freq_factors = None
    if c.rope_freq_factors:
      freq_factors = self.param("rope_freqs", nn.initializers.ones, (c.head_dim // 2,))
    embed = Embed(c.vocab, c.dim, c.dtype, name="embed")
    x = embed(tokens)
    new_cache = []
    for i, (ck, cv) in enumerate(cache):
      x, ck, cv = Block(c, name=f"layers_{i}")(x, ck, cv, pos, freq_factors)
      new_cache.append((ck, cv))
    x = RMSNorm(c.dim, c.norm_eps, c.dtype, name="norm")(x)
    if c.tied_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="lm_head")(x)
    return logits.astype(jnp.float32), tuple(new_cache)


def init_cache(config: TransformerConfig, length: int, batch: int = 1) -> Cache:
  """An empty KV cache: per layer (k, v), each (batch, length, kv_heads, head_dim) in dtype."""
  shape = (batch, length, config.kv_heads, config.head_dim)
  return tuple(
    (jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype)) for _ in range(config.layers)
  )
