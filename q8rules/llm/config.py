"""A GGUF file's metadata as a `TransformerConfig`, for the archs q8rules runs.

The keys every arch has are read here as llama.cpp's loader reads them (src/llama-model.cpp),
with llama.cpp's defaults when a key is absent; what differs per arch (src/models/<arch>.cpp) is
its `Arch` (q8rules/llm/archs/): the fields its graph fixes, its sliding window, its experts,
its own keys. Nothing here names an arch.

Experts: llama.cpp's loader reads `{arch}.expert_count` and `{arch}.expert_used_count` for every
arch (absent: 0), and each arch's graph fixes the rest (src/models/<arch>.cpp): how the router's
logits become weights and whether the chosen weights are normalised, which an arch declares in
its `Arch.experts` (`q8rules.llm.arch.MoeArch`); `expert_fields` reads a file's keys into the
config's expert fields, refusing what llama.cpp would abort on with a `CheckpointError` naming
the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from q8rules.checkpoint import CheckpointError
from q8rules.llm.arch import Arch, MoeArch, SlidingWindow
from q8rules.llm.archs import ARCHS
from q8rules.models.config import EXPERT_GATINGS, TransformerConfig

SUPPORTED_ARCHS: dict[str, Arch] = ARCHS
"""Archs `load_gguf` runs: `general.architecture` -> its `Arch` (q8rules/llm/archs/)."""


def _get(
  meta: Mapping[str, Any], path: str, key: str, default: Any = None, per_layer: bool = False
) -> Any:
  """The value of `key` (or `default`); with `per_layer`, the first of per-layer values (the
  arch reads them all itself: `Arch.layer_arrays`)."""
  value = meta.get(key, default)
  if value is None:
    raise CheckpointError(f"{path}: metadata has no {key!r}, which the model needs")
  if isinstance(value, list | tuple):
    if per_layer and value:
      return value[0]
    raise CheckpointError(f"{path}: per-layer values of {key!r} are not supported: {value}")
  return value


def _ffn_default(meta: Mapping[str, Any], arch: Arch) -> Any:
  """`feed_forward_length` where a file lacks it: the value of `Arch.ffn_key`; else llama.cpp's
  0 in an arch whose experts have their own width (the key only gives that width when
  `expert_feed_forward_length` is absent: `expert_fields`); else None (required: dense FFN
  tensors, or llama's experts, are as wide as it; llama.cpp reads 0 there, then fails on their
  shapes)."""
  if arch.ffn_key is not None:
    return meta.get(f"{arch.name}.{arch.ffn_key}")
  return 0 if arch.experts is not None and arch.experts.own_ffn else None


def _local_layers(
  meta: Mapping[str, Any], path: str, arch: str, swa: SlidingWindow, layers: int
) -> tuple:
  """(window, per-layer local flags) as llama.cpp's `load_swa_pattern` reads them."""
  default_window, period, _ = swa
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


def _sliding_fields(
  meta: Mapping[str, Any], path: str, arch: str, swa: SlidingWindow, c: dict[str, Any]
) -> dict[str, Any]:
  """The sliding-window fields of an arch with `swa` (its `Arch.sliding_window`): the window,
  the local layers, their rope base and scale."""
  out: dict[str, Any] = {}
  out["sliding_window"], out["local_layers"] = _local_layers(meta, path, arch, swa, c["layers"])
  key = f"{arch}.rope.freq_base_swa"
  if swa.shared_rope:  # llama.cpp: local layers share the base and scale
    out["rope_base_local"] = float(meta.get(key, c["rope_base"]))
    out["rope_factor_local"] = c["rope_factor"]
  else:
    out["rope_base_local"] = float(meta.get(key, 10000.0))
  return out


def _int(meta: Mapping[str, Any], path: str, key: str, default: int) -> int:
  """An integer key, or one value for every layer (llama.cpp's get_key_or_arr; per-layer
  values that differ are refused)."""
  value = meta.get(key, default)
  if isinstance(value, list | tuple):
    if len(set(value)) != 1:
      raise CheckpointError(f"{path}: per-layer values of {key!r} that differ: {list(value)}")
    value = value[0]
  try:
    return int(value)
  except (TypeError, ValueError):
    raise CheckpointError(f"{path}: {key!r} must be an integer, got {value!r}") from None


def _gating(meta: Mapping[str, Any], path: str, key: str) -> None:
  """Refuse an `expert_gating_func` value llama.cpp does not know (1-4: its
  `llama_expert_gating_func_type`); an arch with `Arch.experts` fixes its gating whatever it
  says, as llama.cpp's graphs do."""
  value = meta.get(key)
  if value is None:
    return
  names = {str(i + 1): name for i, name in enumerate(EXPERT_GATINGS)}
  if str(value) not in names:
    known = ", ".join(f"{k} ({v})" for k, v in names.items())
    raise CheckpointError(f"{path}: unknown expert gating function {key}={value!r}; known: {known}")


def expert_fields(
  meta: Mapping[str, Any],
  path: str,
  arch: str,
  moe: MoeArch,
  ffn: int,
  tensors: Mapping[str, Any],
) -> dict[str, Any]:
  """The config's expert fields of a file of `arch` (empty for a file without experts).

  Args:
    meta: the file's metadata.
    path: the file, for messages.
    arch: its `general.architecture` (the keys' prefix).
    moe: what the arch's graph fixes of its experts.
    ffn: its `feed_forward_length` (qwen3moe: 0 when absent, as llama.cpp reads it).
    tensors: its tensor names (a llama file with `ffn_*_exps` and no `expert_count` is
      refused, naming the key).

  Raises:
    CheckpointError naming the key: no experts in an arch that needs them, experts used
      outside [1, expert_count], an unknown gating function, expert tensors without a count,
      no experts' width (neither `expert_feed_forward_length` nor `feed_forward_length`).
  """
  a = f"{arch}."
  experts = _int(meta, path, a + "expert_count", 0)
  used = _int(meta, path, a + "expert_used_count", 0)
  if experts <= 0:
    with_experts = sorted(n for n in tensors if n.split(".")[-2:-1] == ["ffn_up_exps"])
    if moe.required or with_experts:
      why = f"it has {with_experts[0]!r}" if with_experts else f"{arch} needs experts"
      raise CheckpointError(f"{path}: {a}expert_count is {experts} (absent: 0), but {why}")
    return {}
  if not 1 <= used <= experts:
    raise CheckpointError(
      f"{path}: {a}expert_used_count {used} must be in [1, {a}expert_count {experts}]"
    )
  _gating(meta, path, a + "expert_gating_func")
  expert_ffn = ffn
  if moe.own_ffn:
    expert_ffn = _int(meta, path, a + "expert_feed_forward_length", 0) or ffn // used
  if expert_ffn <= 0:
    raise CheckpointError(
      f"{path}: the experts' width is unknown: {a}expert_feed_forward_length is absent and"
      f" {a}feed_forward_length is {ffn} (absent: 0; llama.cpp takes it / expert_used_count)"
    )
  return dict(
    experts=experts,
    experts_used=used,
    expert_ffn=expert_ffn,
    expert_gating=moe.gating,
    expert_weights_norm=moe.weights_norm,
  )


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
  spec = SUPPORTED_ARCHS[arch]
  a = f"{arch}."
  dim = int(_get(meta, path, a + "embedding_length"))
  heads = int(_get(meta, path, a + "attention.head_count"))
  arrays = spec.layer_arrays
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
  ffn_default = _ffn_default(meta, spec)
  fields = dict(spec.fields)
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
  if spec.check is not None:
    spec.check(meta, path)
  if spec.sliding_window is not None:
    fields.update(_sliding_fields(meta, path, arch, spec.sliding_window, fields))
  if spec.experts is not None:
    fields.update(expert_fields(meta, path, arch, spec.experts, fields["ffn"], tensors))
  if spec.read is not None:
    fields.update(spec.read(meta, path, fields, tensors))
  config = TransformerConfig(**fields)
  return dataclasses.replace(config, scan_layers=True) if config.uniform_layers else config


__all__ = ["SUPPORTED_ARCHS", "config_from_metadata", "expert_fields"]
