"""Gemma 4's per-layer embeddings (E2B / E4B), as llama.cpp's graph computes them
(src/models/gemma4.cpp: `build_inp_per_layer`, `project_per_layer_inputs` and the end of each
layer), in plain Flax.

With L layers, P = `TransformerConfig.per_layer_dim` and x the scaled token embeddings
(B, T, dim):

  per-layer inputs   e   = per_layer_token_embd[tokens] * sqrt(P)           (B, T, L, P)
                     p   = rms_norm(x @ per_layer_model_proj / sqrt(dim)) * per_layer_proj_norm
                     in  = (p + e) / sqrt(2)                                  (B, T, L, P)
  end of layer i     y   = x_i + post_norm(proj(gelu(inp_gate(x_i)) * in[:, :, i]))

`PerLayerInputs` is the first part (params `per_layer/token_embd` (L * P, vocab), the table in
kernel layout as the token embeddings' (`Embed`), looked up by columns; `per_layer/per_layer_model_proj/kernel` (dim, L * P), which
`q8rules.rules.KEEP_FLOAT` keeps float as llama.cpp's quantizer keeps per_layer_model_proj;
`per_layer/proj_norm/scale` (P,)); `PerLayerBranch` the second (params `gate` (dim, P),
`proj` (P, dim), `norm` (dim,), under the layer's `ple`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from q8rules.models.config import TransformerConfig


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) over the last axis, in float32 (llama.cpp's `ggml_rms_norm`)."""
  xf = x.astype(jnp.float32)
  return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class PerLayerInputs(nn.Module):
  """tokens (B, T) int32 and the scaled embeddings x (B, T, dim) -> every layer's per-layer
  input (B, T, layers, P) float32."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
    c = self.config
    n, width = c.layers * c.per_layer_dim, c.per_layer_dim
    table = self.param("token_embd", nn.initializers.normal(1.0), (n, c.vocab), jnp.float32)
    cols = jnp.take(table, tokens, axis=1)  # (L * P, B, T): the looked-up columns
    looked_up = jnp.moveaxis(cols, 0, -1).astype(jnp.float32) * jnp.float32(math.sqrt(width))
    proj = nn.Dense(n, use_bias=False, dtype=c.dtype, name="per_layer_model_proj")(x)
    proj = proj.astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(c.dim))
    proj = proj.reshape(*proj.shape[:-1], c.layers, width)
    scale = self.param("proj_norm", nn.initializers.ones, (width,), jnp.float32)
    proj = rms_normalize(proj, c.norm_eps) * scale
    out = (proj + looked_up.reshape(proj.shape)) * jnp.float32(1.0 / math.sqrt(2.0))
    return out


class PerLayerBranch(nn.Module):
  """The end of a layer: x (B, T, dim) and its per-layer input (B, T, P) float32 ->
  x + norm(proj(gelu(gate(x)) * input)) in the config's dtype."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array, per_layer: jax.Array) -> jax.Array:
    c = self.config
    gate = nn.Dense(c.per_layer_dim, use_bias=False, dtype=c.dtype, name="gate")(x)
    h = nn.gelu(gate, approximate=True).astype(jnp.float32) * per_layer
    y = nn.Dense(c.dim, use_bias=False, dtype=c.dtype, name="proj")(h.astype(c.dtype))
    scale = self.param("norm", nn.initializers.ones, (c.dim,), jnp.float32)
    y = rms_normalize(y, c.norm_eps) * scale
    return (x.astype(jnp.float32) + y).astype(c.dtype)


__all__ = ["PerLayerBranch", "PerLayerInputs", "rms_normalize"]
