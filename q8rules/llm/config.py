"""A GGUF file's metadata as a `TransformerConfig`, for the archs q8rules runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from q8rules.checkpoint import CheckpointError
from q8rules.models.transformer import TransformerConfig

SUPPORTED_ARCHS: dict[str, dict[str, Any]] = {
  # llama.cpp's converter permutes llama's q/k rows for ggml's NORM rope (interleaved pairs)
  "llama": dict(rope_style="interleaved", qkv_bias=False),
  # qwen2 keeps HF's order and runs NEOX rope (halves); q, k, v have biases
  "qwen2": dict(rope_style="halves", qkv_bias=True),
}
"""Archs `load_gguf` runs, with what distinguishes them."""


def _get(meta: Mapping[str, Any], path: str, key: str, default: Any = None) -> Any:
  value = meta.get(key, default)
  if value is None:
    raise CheckpointError(f"{path}: metadata has no {key!r}, which the model needs")
  return value


def config_from_metadata(
  meta: Mapping[str, Any],
  *,
  path: str,
  vocab: int,
  tied_embeddings: bool,
  rope_freq_factors: bool,
  dtype: Any = jnp.bfloat16,
) -> TransformerConfig:
  """The model's hyperparameters from GGUF metadata (`{arch}.*` keys, as llama.cpp reads them).

  Args:
    meta: the file's key-value metadata (`GGUFCheckpoint.metadata`).
    path: the file, for error messages.
    vocab: rows of `token_embd.weight` (the metadata's vocab size is optional).
    tied_embeddings: the file has no `output.weight`.
    rope_freq_factors: the file has a `rope_freqs.weight`.
    dtype: activation dtype.

  Raises:
    CheckpointError: an arch not in SUPPORTED_ARCHS, a missing key, a rope
      scaling type other than none / linear, heads that do not divide.
  """
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise CheckpointError(
      f"{path}: unsupported architecture {arch!r}; load_gguf runs {sorted(SUPPORTED_ARCHS)}"
    )
  a = f"{arch}."
  dim = int(_get(meta, path, a + "embedding_length"))
  heads = int(_get(meta, path, a + "attention.head_count"))
  kv_heads = int(meta.get(a + "attention.head_count_kv", heads))
  head_dim = int(meta.get(a + "attention.key_length", dim // heads))
  rope_dims = int(meta.get(a + "rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise CheckpointError(
      f"{path}: partial rotary embeddings ({a}rope.dimension_count {rope_dims} of head"
      f" dim {head_dim}) are not supported"
    )
  if heads % kv_heads:
    raise CheckpointError(f"{path}: {heads} heads are not a multiple of {kv_heads} KV heads")
  scaling = meta.get(a + "rope.scaling.type", "none")
  factor = float(meta.get(a + "rope.scaling.factor", 1.0) or 1.0)
  if scaling not in ("none", "linear"):
    raise CheckpointError(
      f"{path}: rope scaling {scaling!r} is not supported (only none and linear)"
    )
  return TransformerConfig(
    arch=arch,
    vocab=vocab,
    dim=dim,
    layers=int(_get(meta, path, a + "block_count")),
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
    ffn=int(_get(meta, path, a + "feed_forward_length")),
    rope_base=float(meta.get(a + "rope.freq_base", 10000.0)),
    rope_scaling=None if scaling == "none" else scaling,
    rope_factor=factor,
    rope_freq_factors=rope_freq_factors,
    norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
    context_length=int(meta.get(a + "context_length", 2048)),
    tied_embeddings=tied_embeddings,
    dtype=dtype,
    **SUPPORTED_ARCHS[arch],
  )
