"""A GGUF file's metadata as a `TransformerConfig`, for the archs q8rules runs.

Each arch reads the keys llama.cpp's loader reads for it (src/llama-model.cpp and
src/models/<arch>.cpp), with llama.cpp's defaults when a key is absent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from q8rules.checkpoint import CheckpointError
from q8rules.llm import gemma4, gpt_oss
from q8rules.llm.experts import MOE_ARCHS, expert_fields
from q8rules.models.config import TransformerConfig

_GEMMA = dict(rope_style="halves", embed_scale=True, activation="gelu_tanh")

SUPPORTED_ARCHS: dict[str, dict[str, Any]] = {
  # llama.cpp's converter permutes llama's q/k rows for ggml's NORM rope (interleaved pairs)
  "llama": dict(rope_style="interleaved"),
  # the others keep HF's order and run NEOX rope (halves)
  "qwen2": dict(rope_style="halves", qkv_bias=True),
  "qwen3": dict(rope_style="halves", qk_norm=True),
  "qwen3moe": dict(rope_style="halves", qk_norm=True),  # + experts (q8rules/llm/experts.py)
  "gemma": dict(_GEMMA, tied_embeddings=True),
  "gemma2": dict(_GEMMA, tied_embeddings=True, post_norms=True),
  "gemma3": dict(_GEMMA, post_norms=True, qk_norm=True),
  "phi3": dict(rope_style="halves", fused_qkv=True, fused_gate_up=True),
  gpt_oss.ARCH: gpt_oss.FIELDS,  # + experts (q8rules/llm/experts.py)
  "gemma4": dict(_GEMMA, post_norms=True, qk_norm=True),
}
"""Archs `load_gguf` runs, with the config fields that distinguish them (the rest come from
the metadata: `config_from_metadata`)."""

SLIDING_WINDOW = {
  "gemma2": (4096, 2),
  "gemma3": (None, 6),
  gpt_oss.ARCH: (None, gpt_oss.SWA_PERIOD),
}
"""Archs with sliding-window layers: (llama.cpp's default window, None when the layers are
all global without the key; its default pattern period: layer i is local unless
i % period == period - 1)."""

LARGE_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The 27B models, whose attention scale llama.cpp takes as 1 / sqrt(dim / heads)
(gemma_pytorch's query_pre_attn_scalar) instead of 1 / sqrt(head_dim)."""


def _get(
  meta: Mapping[str, Any], path: str, key: str, default: Any = None, per_layer: bool = False
) -> Any:
  """The value of `key` (or `default`); with `per_layer`, the first of per-layer values (the
  arch reads them all itself: gemma4's `LAYER_ARRAYS`)."""
  value = meta.get(key, default)
  if value is None:
    raise CheckpointError(f"{path}: metadata has no {key!r}, which the model needs")
  if isinstance(value, list | tuple):
    if per_layer and value:
      return value[0]
    raise CheckpointError(f"{path}: per-layer values of {key!r} are not supported: {value}")
  return value


def _ffn_default(arch: str) -> int | None:
  """`feed_forward_length` where a file lacks it: llama.cpp's 0 in an arch whose experts have
  their own width (qwen3moe: the key only gives that width when `expert_feed_forward_length`
  is absent: `expert_fields`); None (required) where dense FFN tensors or llama's experts are
  as wide as it (llama.cpp reads 0 there too, then fails on those tensors' shapes)."""
  moe = MOE_ARCHS.get(arch)
  return 0 if moe is not None and moe.own_ffn else None


def _local_layers(meta: Mapping[str, Any], path: str, arch: str, layers: int) -> tuple:
  """(window, per-layer local flags) as llama.cpp's `load_swa_pattern` reads them."""
  default_window, period = SLIDING_WINDOW[arch]
  key = f"{arch}.attention.sliding_window"
  window = int(meta.get(key, default_window) or 0)
  if window <= 0:
    return 0, ()
  pattern = meta.get(f"{arch}.attention.sliding_window_pattern", period)
  if isinstance(pattern, list | tuple):
    if len(pattern) != layers:
      raise CheckpointError(
        f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for"
        f" {layers} layers"
      )
    return window, tuple(bool(p) for p in pattern)
  n = int(pattern)
  return window, tuple(n == 0 or i % n < n - 1 for i in range(layers))


def _arch_fields(
  meta: Mapping[str, Any], path: str, arch: str, c: dict[str, Any]
) -> dict[str, Any]:
  """The fields that depend on an arch's own keys and llama.cpp's per-arch defaults."""
  a = f"{arch}."
  out: dict[str, Any] = {}
  if arch in SLIDING_WINDOW:
    out["sliding_window"], out["local_layers"] = _local_layers(meta, path, arch, c["layers"])
    if arch in ("gemma2", gpt_oss.ARCH):  # llama.cpp: local layers share the base and scale
      out["rope_base_local"] = float(meta.get(a + "rope.freq_base_swa", c["rope_base"]))
      out["rope_factor_local"] = c["rope_factor"]
    else:
      out["rope_base_local"] = float(meta.get(a + "rope.freq_base_swa", 10000.0))
    if c["layers"] == LARGE_GEMMA_LAYERS.get(arch):
      out["attn_scale"] = 1.0 / math.sqrt(c["dim"] / c["heads"])
  if arch == "gemma2":
    out["attn_softcap"] = float(meta.get(a + "attn_logit_softcapping", 50.0))
    out["final_softcap"] = float(meta.get(a + "final_logit_softcapping", 30.0))
  if arch == "gemma3":
    out["final_softcap"] = float(meta.get(a + "final_logit_softcapping", 0.0))
  return out


def config_from_metadata(
  meta: Mapping[str, Any],
  *,
  path: str,
  vocab: int,
  tensors: Mapping[str, Any],
  dtype: Any = jnp.bfloat16,
) -> TransformerConfig:
  """The model's hyperparameters from GGUF metadata (`{arch}.*` keys, as llama.cpp reads them).

  Args:
    meta: the file's key-value metadata (`GGUFCheckpoint.metadata`).
    path: the file, for error messages.
    vocab: rows of `token_embd.weight` (the metadata's vocab size is optional).
    tensors: the file's tensor names (what is optional in an arch is chosen by presence,
      as llama.cpp does: `output.weight` (untied), `attn_qkv` (fused), `rope_freqs`,
      `rope_factors_long` / `_short`).
    dtype: activation dtype.

  Raises:
    CheckpointError: an arch not in SUPPORTED_ARCHS, a missing key, per-layer values,
      partial rotary embeddings, a rope scaling type other than none / linear / longrope /
      yarn, heads that do not divide, a value length other than the key length.
  """
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise CheckpointError(
      f"{path}: unsupported architecture {arch!r}; load_gguf runs {sorted(SUPPORTED_ARCHS)}"
    )
  a = f"{arch}."
  dim = int(_get(meta, path, a + "embedding_length"))
  heads = int(_get(meta, path, a + "attention.head_count"))
  arrays = gemma4.LAYER_ARRAYS if arch == gemma4.ARCH else ()
  kv_heads = int(
    _get(meta, path, a + "attention.head_count_kv", heads, "attention.head_count_kv" in arrays)
  )
  head_dim = int(_get(meta, path, a + "attention.key_length", dim // heads))
  value_dim = int(_get(meta, path, a + "attention.value_length", head_dim))
  if value_dim != head_dim:
    raise CheckpointError(
      f"{path}: {a}attention.value_length {value_dim} differs from the key length {head_dim}"
    )
  rope_dims = int(_get(meta, path, a + "rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise CheckpointError(
      f"{path}: partial rotary embeddings ({a}rope.dimension_count {rope_dims} of head"
      f" dim {head_dim}) are not supported"
    )
  if heads % kv_heads:
    raise CheckpointError(f"{path}: {heads} heads are not a multiple of {kv_heads} KV heads")
  factor = meta.get(a + "rope.scaling.factor") or meta.get(a + "rope.scale_linear") or 1.0
  scaling = meta.get(a + "rope.scaling.type", "linear" if float(factor) != 1.0 else "none")
  if scaling not in ("none", "linear", "longrope", "yarn"):
    raise CheckpointError(
      f"{path}: {a}rope.scaling.type {scaling!r} is not supported (none, linear, longrope, yarn)"
    )
  context = int(_get(meta, path, a + "context_length", 2048))
  ffn_default = gpt_oss.default_ffn(meta) if arch == gpt_oss.ARCH else _ffn_default(arch)
  fields = dict(SUPPORTED_ARCHS[arch])
  fields.setdefault("tied_embeddings", "output.weight" not in tensors)
  fields.update(
    arch=arch,
    vocab=vocab,
    dim=dim,
    layers=int(_get(meta, path, a + "block_count")),
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
    ffn=int(
      _get(meta, path, a + "feed_forward_length", ffn_default, "feed_forward_length" in arrays)
    ),
    rope_base=float(_get(meta, path, a + "rope.freq_base", 10000.0)),
    rope_scaling=None if scaling == "none" else scaling,
    rope_factor=float(factor),
    rope_attn_factor=float(_get(meta, path, a + "rope.scaling.attn_factor", 1.0)),
    rope_original_context=int(
      _get(meta, path, a + "rope.scaling.original_context_length", context)
    ),
    norm_eps=float(_get(meta, path, a + "attention.layer_norm_rms_epsilon", 1e-5)),
    context_length=context,
    fused_qkv="blk.0.attn_qkv.weight" in tensors,
    dtype=dtype,
  )
  # llama.cpp reads rope_freqs for llama; LongRoPE factors for phi3, and for llama in longrope
  if arch == "llama" and scaling != "longrope":
    fields["rope_freq_factors"] = "rope_freqs.weight" in tensors
  if arch == "phi3" or (arch == "llama" and scaling == "longrope"):
    fields["rope_long_short"] = "rope_factors_long.weight" in tensors
  if arch == gpt_oss.ARCH:
    gpt_oss.check_keys(meta, path)
  fields.update(_arch_fields(meta, path, arch, fields))
  fields.update(expert_fields(meta, path, arch, fields["ffn"], tensors))
  if arch == gemma4.ARCH:
    fields.update(gemma4.gemma4_fields(meta, path, fields, tensors))
  config = TransformerConfig(**fields)
  return dataclasses.replace(config, scan_layers=True) if config.uniform_layers else config
