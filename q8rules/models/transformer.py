"""The one decoder: a config-driven, llama.cpp-shaped transformer in plain Flax linen.

It is the model the demo, the README, the notebooks and `q8rules.llm.load_gguf`
run. Nothing in it knows about quantization: its weights are `nn.Dense` kernels
(in, out) and one embedding table, and `qwix.quantize_model` with
`q8rules.Q8Rule`s serves them as Q8_0 (the table too: its lookup and, with tied
embeddings, the output projection read the same Q8_0 values).

What the archs (llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3) differ in is a
field of `TransformerConfig` (q8rules/models/config.py says which arch sets what):

  * grouped-query attention: `kv_heads` key/value heads, each shared by
    `heads // kv_heads` query heads; `head_dim` need not be dim / heads;
  * RoPE in llama.cpp's two conventions (`rope_style`):
      - 'interleaved' (ggml's NORM mode, arch `llama`): rotates the pairs
        (x[2i], x[2i+1]). llama.cpp's HF converter permutes the rows of
        attn_q / attn_k so that this mode equals HF's rotate-half on the
        original weights; using the same mode here means the file's rows are
        used as stored (no un-permutation, no copy);
      - 'halves' (ggml's NEOX mode, the other archs): rotates (x[i], x[i + H/2]);
    the angle of pair i at position p is `p * scale * base**(-2i/H) / f_i`
    (`scale` = 1 / linear factor, `f_i` from a `rope_freqs` table (Llama 3.1) or
    Phi-3's LongRoPE long / short factors); local layers have their own base and scale;
  * biases on q, k, v (`qkv_bias`); fused q|k|v and gate|up matrices (`fused_*`);
  * QK-norm, post-attention / post-FFN norms, embeddings scaled by sqrt(dim),
    SwiGLU or GELU-tanh GeGLU, attention and final-logit soft-capping;
  * sliding-window layers (`local_layers`, `sliding_window`): their KV cache is a
    ring buffer of the window's length (q8rules/models/attention.py);
  * a mixture of experts in place of the FFN (`experts`; q8rules/models/moe.py);
  * tied embeddings: the table (dim, vocab), GGUF's `token_embd` in kernel
    layout, is the output projection too (one param, no second copy).

Layers run under `nn.scan` over stacked params (`scan_layers=True`, the
default: one layer is traced, whatever the depth) or unrolled
(`layers_0`, `layers_1`, ...). A scanned apply (`scan_in_place`, the default) broadcasts
the stacked params into the scan and gives step i layer i by index (`hooks.take_layer`;
under a q8rules provider a Q8_0 weight stays one stacked array that the native CPU kernel
reads in place, where `nn.scan`'s own slicing makes XLA copy every weight every step). The scan's per-layer inputs are the layer's kind
(local or global) and its index in that kind's stacked cache; a model with both
kinds runs each layer's attention under `lax.cond`, so every scan step has the
same shapes.

Shapes: tokens (B, T) int32 -> logits (B, T, vocab) float32. Activations run in
`dtype`; norms, RoPE and softmax in float32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from q8rules.models import hooks
from q8rules.models.attention import (
  PENDING,
  Cache,
  apply_rope,
  as_groups,
  attention,
  attention_deferred,
  attention_shared,
  cache_on_mesh,
  check_cache,
  from_groups,
  init_cache,
  rope_angles,
  rope_mscale,
  write_pending,
)
from q8rules.models.config import RopeStyle, TransformerConfig
from q8rules.models.moe import Moe, gated
from q8rules.models.per_layer import PerLayerBranch, PerLayerInputs, rms_normalize


class RMSNorm(nn.Module):
  """llama.cpp's RMS norm over the last axis: x * rsqrt(mean(x^2) + eps) * scale, in float32.

  The scale (dim,) is used as stored (Gemma's converter stores 1 + w, as llama.cpp reads it).
  """

  dim: int
  eps: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (self.dim,), jnp.float32)
    y = rms_normalize(x, self.eps)
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


def _norm(dim: int, name: str, config: TransformerConfig) -> RMSNorm:
  return RMSNorm(dim, config.norm_eps, config.dtype, name=name)


class Attention(nn.Module):
  """Causal GQA self-attention with RoPE over one layer's slice of the KV cache.

  `index` is the layer's when the layers run unrolled (None under `nn.scan`): a layer past
  `kv_layers` computes no K and V and attends over its source layer's (`_shared_kv`).
  """

  config: TransformerConfig
  index: int | None = None

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    groups: dict[str, Any],
    kind: tuple[Any, Any],
    pos: jax.Array | int,
    angles: dict[str, jax.Array],
  ) -> tuple[jax.Array, dict[str, Any]]:
    """x (B, T, dim), the cache as {kind: (k, v)}, (local, slot) of this layer, the position
    of x[:, 0], the RoPE angles (T, head_dim / 2) per kind -> (B, T, dim), the cache."""
    c = self.config
    if self.index is not None and self.index >= c.kv_layers:
      return self._shared_kv(x, groups, kind, pos, angles)
    b, t, _ = x.shape
    q_out, kv_out = c.heads * c.head_dim, c.kv_heads * c.head_dim
    if c.fused_qkv:
      qkv = _dense(q_out + 2 * kv_out, "qkv", c, c.qkv_bias)(x)
      q, k, v = jnp.split(qkv, [q_out, q_out + kv_out], axis=-1)
    else:
      q = _dense(q_out, "q", c, c.qkv_bias)(x)
      k = _dense(kv_out, "k", c, c.qkv_bias)(x)
      v = k if c.layer_k_as_v and c.layer_k_as_v[self.index or 0] else None
      v = _dense(kv_out, "v", c, c.qkv_bias)(x) if v is None else v
    q = q.reshape(b, t, c.heads, c.head_dim)
    k = k.reshape(b, t, c.kv_heads, c.head_dim)
    v = v.reshape(b, t, c.kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = _norm(c.head_dim, "q_norm", c)(q), _norm(c.head_dim, "k_norm", c)(k)
    if c.v_norm:
      v = rms_normalize(v, c.norm_eps).astype(v.dtype)
    local, slot = kind
    ang = _of_kind(angles, local)
    mscale = _of_kind({k: rope_mscale(c, k == "local") for k in angles}, local)
    q = apply_rope(q, ang, c.rope_style, mscale)
    k = apply_rope(k, ang, c.rope_style, mscale)
    sinks = None
    if c.attn_sinks:
      sinks = self.param("sinks", nn.initializers.zeros, (c.heads,), jnp.float32)
    if self.index is not None and self.index == _deferring(c):
      out, groups = attention_deferred(c, q, k, v, groups, slot, pos)
    else:
      out, groups = attention(c, q, k, v, groups, local, slot, pos, sinks)
    return _dense(c.dim, "o", c, c.attn_output_bias)(out), groups

  def _shared_kv(
    self, x: jax.Array, groups: dict[str, Any], kind: Any, pos: Any, angles: dict[str, Any]
  ) -> tuple[jax.Array, dict[str, Any]]:
    """A layer that computes no K and V: its q alone, over the KV of its source layer
    (`attention_shared`); the cache as it was."""
    c = self.config
    b, t, _ = x.shape
    q = _dense(c.heads * c.head_dim, "q", c, c.qkv_bias)(x).reshape(b, t, c.heads, c.head_dim)
    if c.qk_norm:
      q = _norm(c.head_dim, "q_norm", c)(q)
    local, slot = kind
    q = apply_rope(q, _of_kind(angles, local), c.rope_style, rope_mscale(c, local))
    out = attention_shared(c, q, groups, local, slot, pos)
    return _dense(c.dim, "o", c, c.attn_output_bias)(out), groups


def _deferring(c: TransformerConfig) -> int | None:
  """The local layer whose KV later layers share (its ring is written after them), or None."""
  sharing = [i for i in range(c.kv_layers, c.layers) if c.is_local[i]]
  return c.kv_source(sharing[0]) if sharing else None


def _of_kind(values: dict[str, Any], local: Any) -> Any:
  """This layer's entry of a dict per kind of layer ('global', 'local'); `local` a Python bool,
  or a traced one (scanned layers of both kinds: a select, unless both entries are one float)."""
  if len(values) == 1:
    (value,) = values.values()
    return value
  if isinstance(local, bool):
    return values["local" if local else "global"]
  here, there = values["local"], values["global"]
  if isinstance(here, float) and here == there:
    return here
  return jnp.where(local, here, there)


class Mlp(nn.Module):
  """Gated FFN: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU-tanh (GeGLU)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    if c.fused_gate_up:
      gate, up = jnp.split(_dense(2 * c.ffn, "up", c)(x), 2, axis=-1)
    else:
      gate, up = _dense(c.ffn, "gate", c)(x), _dense(c.ffn, "up", c)(x)
    return _dense(c.dim, "down", c)(gated(c, gate, up))


class Block(nn.Module):
  """One pre-norm block: x + attn(norm(x)), then + mlp(norm(x)) (the experts, `moe`, when
  `config.experts`); with `post_norms` each branch's output is normalized before its residual
  add.

  Called as `nn.scan` calls it: `(carry, kind, pos, angles) -> (carry, None)` with
  carry = (x, cache groups) and kind = (local, slot) of this layer. Unrolled, `index` is the
  layer's (its widths are `config.layer(index)`'s) and `per_layer` its per-layer input
  (B, T, P) when the model has per-layer embeddings (`PerLayerBranch` ends the block); with
  `layer_out_scale` the block's output is multiplied by its `out_scale` (1,).
  """

  config: TransformerConfig
  index: int | None = None

  @nn.compact
  def __call__(
    self,
    carry: tuple[jax.Array, dict[str, Any]],
    kind: Any,
    pos: Any,
    angles: Any,
    per_layer: jax.Array | None = None,
  ) -> tuple[tuple[jax.Array, dict[str, Any]], None]:
    c = self.config if self.index is None else self.config.layer(self.index)
    x, groups = carry
    h, groups = Attention(c, self.index, name="attn")(
      _norm(c.dim, "attn_norm", c)(x), groups, kind, pos, angles
    )
    if c.post_norms:
      h = _norm(c.dim, "post_attn_norm", c)(h)
    x = x + h
    if c.experts and c.expert_dense_branch:
      h = _dense_and_experts(c, x)
    else:
      ffn = Moe(c, name="moe") if c.experts else Mlp(c, name="mlp")
      h = ffn(_norm(c.dim, "mlp_norm", c)(x))
    if c.post_norms:
      h = _norm(c.dim, "post_mlp_norm", c)(h)
    x = x + h
    if per_layer is not None:
      x = PerLayerBranch(c, name="ple")(x, per_layer)
    if c.layer_out_scale:
      scale = self.param("out_scale", nn.initializers.ones, (1,), jnp.float32)
      x = (x.astype(jnp.float32) * scale).astype(c.dtype)
    return (x, groups), None


def _dense_and_experts(c: TransformerConfig, x: jax.Array) -> jax.Array:
  """Gemma 4's FFN of the residual x (B, T, dim) in a block's scope (its modules are the
  block's): post_mlp_norm_1(mlp(mlp_norm(x))) + post_mlp_norm_2(moe(mlp_norm_2(x))), the
  router reading x (`expert_router_norm`)."""
  dense = _norm(c.dim, "post_mlp_norm_1", c)(Mlp(c, name="mlp")(_norm(c.dim, "mlp_norm", c)(x)))
  experts = Moe(c, name="moe")(_norm(c.dim, "mlp_norm_2", c)(x), router_x=x)
  return dense + _norm(c.dim, "post_mlp_norm_2", c)(experts)


class LayerStep(nn.Module):
  """One step of the in-place scan: `Block` on layer i of the stacked params, which the scan
  broadcasts (`hooks.take_layer(params, i)`); its params live where the scanned Block's do.

  Called as `(carry, (kind, i), pos, angles) -> (carry, None)`.
  """

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, carry: tuple[jax.Array, dict[str, Any]], xs: Any, pos: Any, angles: Any
  ) -> tuple[tuple[jax.Array, dict[str, Any]], None]:
    kind, i = xs
    block = nn.map_variables(
      Block, "params", trans_in_fn=lambda v: hooks.take_layer(v, i), mutable=False
    )(self.config)
    nn.share_scope(self, block)
    return block(carry, kind, pos, angles)


def cache_length(cache: Any) -> int:
  """The longest cache axis in `cache` (a global layer's length: the context it runs with)."""
  return max(leaf.shape[2] for leaf in jax.tree.leaves(cache))


class Transformer(nn.Module):
  """tokens (B, T) int32, cache, pos -> logits (B, T, vocab) float32, the updated cache.

  `pos` is the position of tokens[:, 0] (a scalar, or int32 (B,): each row its own); the cache
  holds positions [0, pos) already and gets [pos, pos + T) written. With `last_only` the logits are those of the
  last position only, (B, 1, vocab): what a prefill needs, and the final norm and the output
  head then run on one row per sequence instead of T.
  """

  config: TransformerConfig

  def _freq_factors(self, cache: Any) -> Any:
    c = self.config
    if c.rope_freq_factors:
      return self.param("rope_freqs", nn.initializers.ones, (c.head_dim // 2,))
    if c.rope_long_short:
      long = self.param("rope_factors_long", nn.initializers.ones, (c.head_dim // 2,))
      short = self.param("rope_factors_short", nn.initializers.ones, (c.head_dim // 2,))
      return long if cache_length(cache) > c.rope_original_context else short
    return None

  @nn.compact
  def __call__(
    self, tokens: jax.Array, cache: Cache, pos: jax.Array | int = 0, last_only: bool = False
  ) -> tuple[jax.Array, Cache]:
    c = self.config
    check_cache(c, cache, tokens.shape[0])
    cache = cache_on_mesh(cache)
    factors = self._freq_factors(cache)
    positions = jnp.asarray(pos)[..., None] + jnp.arange(tokens.shape[1])  # (T,) or (B, T)
    # frequency factors reach the global layers only (Gemma 4's rope_freqs, as llama.cpp)
    angles = {
      k: rope_angles(c, positions, None if k == "local" else factors, k == "local")
      for k in c.layer_kinds
    }
    embed = Embed(c.vocab, c.dim, c.dtype, name="embed")
    x = embed(tokens)
    if c.embed_scale:
      x = (x.astype(jnp.float32) * jnp.float32(math.sqrt(c.dim))).astype(c.dtype)
    carry = (x, as_groups(c, cache))
    kinds = (c.is_local, c.cache_slots)
    if c.scan_layers and c.scan_in_place and not self.is_initializing():
      steps = nn.scan(
        LayerStep,
        variable_broadcast="params",
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=c.layers,
      )(c, name="layers")
      xs = (tuple(jnp.asarray(a) for a in kinds), jnp.arange(c.layers, dtype=jnp.int32))
      carry, _ = steps(carry, xs, pos, angles)
    elif c.scan_layers:
      blocks = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=c.layers,
      )(c, name="layers")
      carry, _ = blocks(carry, tuple(jnp.asarray(a) for a in kinds), pos, angles)
    else:
      per_layer = PerLayerInputs(c, name="per_layer")(tokens, x) if c.per_layer_dim else None
      for i in range(c.layers):
        own = None if per_layer is None else per_layer[:, :, i]
        block = Block(c, i, name=f"layers_{i}")
        carry, _ = block(carry, (kinds[0][i], kinds[1][i]), pos, angles, per_layer=own)
    x, groups = carry
    if PENDING in groups:  # a local layer's KV, read by the layers that share it
      groups = write_pending(groups, c.cache_slots[_deferring(c)], pos)
    if last_only:
      x = x[:, -1:]
    x = _norm(c.dim, "norm", c)(x)
    logits = embed.attend(x) if c.tied_embeddings else _dense(c.vocab, "lm_head", c)(x)
    logits = logits.astype(jnp.float32)
    if c.final_softcap:
      logits = jnp.tanh(logits / c.final_softcap) * c.final_softcap
    return logits, from_groups(c, groups)


__all__ = [
  "Attention",
  "Block",
  "Cache",
  "Embed",
  "LayerStep",
  "Mlp",
  "Moe",
  "RMSNorm",
  "RopeStyle",
  "Transformer",
  "TransformerConfig",
  "apply_rope",
  "cache_length",
  "check_cache",
  "init_cache",
  "rope_angles",
]
