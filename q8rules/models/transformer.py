"""The one decoder: a config-driven, llama.cpp-shaped transformer in plain Flax linen.

It is the model the demo, the README, the notebooks and `q8rules.llm.load_gguf`
run. Nothing in it knows about quantization: its weights are `nn.Dense` kernels
(in, out) and one embedding table, and `qwix.quantize_model` with
`q8rules.Q8Rule`s serves them as Q8_0 (the table too: its lookup and, with tied
embeddings, the output projection read the same Q8_0 values).

What the archs differ in is a config field:

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
    model has one, as Llama 3.1's);
  * biases on q, k, v (`qkv_bias`, qwen2);
  * tied embeddings: the table (dim, vocab), GGUF's `token_embd` in kernel
    layout, is the output projection too (one param, no second copy).

Layers run under `nn.scan` over stacked params (`scan_layers=True`, the
default: one layer is traced, whatever the depth) or unrolled
(`layers_0`, `layers_1`, ...). Either way the KV cache is one pair of arrays
(layers, batch, length, kv_heads, head_dim), updated in place at `pos`.

Shapes: tokens (B, T) int32 -> logits (B, T, vocab) float32. Activations run in
`dtype`; norms, RoPE and softmax in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Cache = tuple[jax.Array, jax.Array]
"""(k, v), each (layers, batch, length, kv_heads, head_dim) in the config's dtype."""

RopeStyle = Literal["interleaved", "halves"]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters, in llama.cpp's terms where it has them.

  Attributes:
    arch: the GGUF `general.architecture` this config mirrors ('llama', 'qwen2').
    vocab: tokens in the vocabulary (columns of the embedding table).
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
    context_length: the longest cache `init_cache` may be asked for.
    tied_embeddings: the output projection is the embedding table.
    qkv_bias: q, k and v have biases.
    scan_layers: run the blocks under `nn.scan` (params stacked along a
      leading layer axis, under 'layers') instead of unrolled ('layers_i').
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
  scan_layers: bool = True
  dtype: Any = jnp.float32

  def __post_init__(self) -> None:
    if self.heads % self.kv_heads:
      raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
    if self.rope_style not in ("interleaved", "halves"):
      raise ValueError(f"rope_style must be 'interleaved' or 'halves', got {self.rope_style!r}")
    if self.rope_scaling not in (None, "linear"):
      raise ValueError(f"rope_scaling must be None or 'linear', got {self.rope_scaling!r}")


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
  else:
    half = x.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
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

  `__call__` looks token ids (B, T) up -> (B, T, dim) in `dtype` (`jnp.take` of
  columns); `attend` is x (B, T, dim) @ table -> (B, T, vocab) float32, the
  tied output projection.
  """

  vocab: int
  dim: int
  dtype: Any = jnp.float32

  def setup(self) -> None:
    self.table = self.param(
      "table", nn.initializers.normal(1.0), (self.dim, self.vocab), jnp.float32
    )

  def __call__(self, ids: jax.Array) -> jax.Array:
    cols = jnp.take(self.table, ids, axis=1)  # (dim, B, T)
    return jnp.moveaxis(cols, 0, -1).astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    return jnp.dot(x, self.table, preferred_element_type=jnp.float32)


def _dense(features: int, name: str, config: TransformerConfig, bias: bool = False) -> nn.Dense:
  return nn.Dense(features, use_bias=bias, dtype=config.dtype, name=name)


def _explicit_mesh() -> bool:
  """Whether the mesh in context has Explicit axes (sharding in types)."""
  return bool(jax.sharding.get_abstract_mesh().explicit_axes)


def _cache_on_mesh(cache: Cache) -> Cache:
  """On a mesh with Explicit axes, a cache made off the mesh (`init_cache`) as a replicated
  array on it, so that its updates can be typed (a no-op elsewhere)."""
  if not _explicit_mesh():
    return cache
  return tuple(
    jax.sharding.reshard(a, P()) if jax.typeof(a).sharding.mesh.empty else a for a in cache
  )


def _like_cache(x: jax.Array, cache: jax.Array) -> jax.Array:
  """x (B, T, KV, H) as the cache's update (1, B, T, KV, H) in its dtype and, on a mesh with
  Explicit axes, its sharding: k / v come out split as the projections split them, whatever
  the cache's split (a no-op elsewhere)."""
  update = x.astype(cache.dtype)[None]
  if not _explicit_mesh() or jax.typeof(update).sharding.spec == jax.typeof(cache).sharding.spec:
    return update
  return jax.sharding.reshard(update, jax.typeof(cache).sharding.spec)


class Attention(nn.Module):
  """Causal GQA self-attention with RoPE over one layer's slice of the KV cache."""

  config: TransformerConfig

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    cache: Cache,
    layer: jax.Array | int,
    pos: jax.Array | int,
    freq_factors: Any,
  ) -> tuple[jax.Array, Cache]:
    """x (B, T, dim), the whole cache, this block's layer index, the position of x[:, 0]."""
    c = self.config
    b, t, _ = x.shape
    q = _dense(c.heads * c.head_dim, "q", c, c.qkv_bias)(x).reshape(b, t, c.heads, c.head_dim)
    k = _dense(c.kv_heads * c.head_dim, "k", c, c.qkv_bias)(x).reshape(b, t, c.kv_heads, -1)
    v = _dense(c.kv_heads * c.head_dim, "v", c, c.qkv_bias)(x).reshape(b, t, c.kv_heads, -1)
    positions = pos + jnp.arange(t)
    angles = rope_angles(c, positions, freq_factors)
    q = apply_rope(q, angles, c.rope_style)
    k = apply_rope(k, angles, c.rope_style)
    cache_k, cache_v = cache
    at = (layer, 0, pos, 0, 0)
    cache_k = jax.lax.dynamic_update_slice(cache_k, _like_cache(k, cache_k), at)
    cache_v = jax.lax.dynamic_update_slice(cache_v, _like_cache(v, cache_v), at)
    keys = jax.lax.dynamic_index_in_dim(cache_k, layer, 0, keepdims=False)  # (B, S, KV, H)
    values = jax.lax.dynamic_index_in_dim(cache_v, layer, 0, keepdims=False)
    group = c.heads // c.kv_heads
    qg = q.reshape(b, t, c.kv_heads, group, c.head_dim).astype(jnp.float32)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, keys.astype(jnp.float32))
    scores = scores * (1.0 / float(c.head_dim) ** 0.5)
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]  # (T, S)
    scores = jnp.where(visible[None, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, values.astype(jnp.float32))
    out = out.reshape(b, t, c.heads * c.head_dim).astype(c.dtype)
    return _dense(c.dim, "o", c)(out), (cache_k, cache_v)


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    gate, up = _dense(c.ffn, "gate", c)(x), _dense(c.ffn, "up", c)(x)
    return _dense(c.dim, "down", c)(nn.silu(gate) * up)


class Block(nn.Module):
  """One pre-norm block: x + attn(norm(x)), then + mlp(norm(x)).

  Called as `nn.scan` calls it: `(carry, layer, pos, freq_factors) -> (carry, None)`
  with carry = (x, cache).
  """

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, carry: tuple[jax.Array, Cache], layer: jax.Array | int, pos: Any, freq_factors: Any
  ) -> tuple[tuple[jax.Array, Cache], None]:
    c = self.config
    x, cache = carry
    h, cache = Attention(c, name="attn")(
      RMSNorm(c.dim, c.norm_eps, c.dtype, name="attn_norm")(x), cache, layer, pos, freq_factors
    )
    x = x + h
    x = x + Mlp(c, name="mlp")(RMSNorm(c.dim, c.norm_eps, c.dtype, name="mlp_norm")(x))
    return (x, cache), None


class Transformer(nn.Module):
  """tokens (B, T) int32, cache, pos -> logits (B, T, vocab) float32, the updated cache.

  `pos` is the position of tokens[:, 0]; the cache holds positions [0, pos)
  already and gets [pos, pos + T) written.
  """

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, tokens: jax.Array, cache: Cache, pos: jax.Array | int = 0
  ) -> tuple[jax.Array, Cache]:
    c = self.config
    check_cache(c, cache, tokens.shape[0])
    cache = _cache_on_mesh(cache)
    freq_factors = None
    if c.rope_freq_factors:
      freq_factors = self.param("rope_freqs", nn.initializers.ones, (c.head_dim // 2,))
    embed = Embed(c.vocab, c.dim, c.dtype, name="embed")
    carry = (embed(tokens), cache)
    if c.scan_layers:
      blocks = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=c.layers,
      )(c, name="layers")
      carry, _ = blocks(carry, jnp.arange(c.layers), pos, freq_factors)
    else:
      for i in range(c.layers):
        carry, _ = Block(c, name=f"layers_{i}")(carry, i, pos, freq_factors)
    x, cache = carry
    x = RMSNorm(c.dim, c.norm_eps, c.dtype, name="norm")(x)
    if c.tied_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(c.vocab, "lm_head", c)(x)
    return logits.astype(jnp.float32), cache


def init_cache(config: TransformerConfig, length: int, batch: int = 1) -> Cache:
  """An empty KV cache: (k, v), each (layers, batch, length, kv_heads, head_dim) in dtype."""
  if length > config.context_length:
    raise ValueError(
      f"a cache of {length} positions exceeds context_length {config.context_length}"
    )
  shape = (config.layers, batch, length, config.kv_heads, config.head_dim)
  return jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype)


def check_cache(config: TransformerConfig, cache: Any, batch: int) -> None:
  """Raise a clear error unless `cache` is an `init_cache(config, length, batch)` pair."""
  c = config
  want = (c.layers, batch, None, c.kv_heads, c.head_dim)
  pair = isinstance(cache, tuple | list) and len(cache) == 2
  shapes = [tuple(a.shape) for a in cache] if pair else []
  if not pair or any(
    len(s) != 5 or any(w is not None and w != d for w, d in zip(want, s, strict=True))
    for s in shapes
  ):
    raise ValueError(
      f"the KV cache must be (k, v), each (layers={c.layers}, batch={batch}, length,"
      f" kv_heads={c.kv_heads}, head_dim={c.head_dim}) as init_cache makes it; got"
      f" {shapes or type(cache).__name__}"
    )


__all__ = [
  "Attention",
  "Block",
  "Cache",
  "Embed",
  "Mlp",
  "RMSNorm",
  "Transformer",
  "TransformerConfig",
  "apply_rope",
  "check_cache",
  "init_cache",
  "rope_angles",
]
