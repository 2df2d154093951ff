"""The `gemma4` arch's metadata as `TransformerConfig` fields, read as llama.cpp reads them
(src/models/gemma4.cpp `load_arch_hparams` / `load_arch_tensors`, src/llama-model.cpp
`load_hparams`), with llama.cpp's defaults for absent keys.

What gemma4 reads besides the keys every arch has:

  attention.sliding_window              required; the local layers' window
  attention.sliding_window_pattern      required, one bool per layer (true: local)
  attention.key_length_swa / value_length_swa   required; the local layers' head width (the
                                        global layers' is key_length / value_length)
  rope.dimension_count_swa              default rope.dimension_count; partial rotary refused
  rope.freq_base_swa                    default 10000 (the local layers' base; scale 1)
  embedding_length_per_layer_input      required; 0: no per-layer embeddings
  attention.shared_kv_layers            default 0: the last N layers reuse earlier layers' KV
  final_logit_softcapping               default 30 (llama.cpp's hparams default)
  attention.head_count_kv, feed_forward_length   a value or one per layer (31B / 26B-A4B's
                                        KV heads per kind, E2B's wider FFN on shared layers)
  expert_count, expert_used_count       default 0: experts (26B-A4B), beside the dense FFN
  expert_feed_forward_length            required with experts; the experts' width

and from the tensors: experts as one `ffn_gate_up_exps` stack or gate and up stacks, with or
without a per-expert `ffn_down_exps.scale`; a layer with no `attn_v` uses K's projection as V
(attention_k_eq_v), a `layer_output_scale` multiplies each layer's output, `rope_freqs` divides
the global layers' frequencies (partial rotary as factors of 1e30). The attention scale is 1 (q
and k are RMS-normalized), V is RMS-normalized without a weight. The experts' routing is
llama.cpp's for gemma4: softmax, top-k, the chosen weights normalized; the router reads
rms_norm(x) / sqrt(dim) * `ffn_gate_inp.scale`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from q8rules.checkpoint import CheckpointError
from q8rules.llm.arch import Arch
from q8rules.llm.archs.gemma import GEMMA_FIELDS

NAME = "gemma4"
DEFAULT_FINAL_SOFTCAP = 30.0
"""llama.cpp's `f_final_logit_softcapping` default, which gemma4 (unlike gemma3) keeps."""
LAYER_ARRAYS = ("attention.head_count_kv", "feed_forward_length")
"""The keys a gemma4 file may give per layer (llama.cpp's get_key_or_arr); an array for any
other key is refused."""


def _required(meta: Mapping[str, Any], path: str, key: str) -> Any:
  value = meta.get(f"{NAME}.{key}")
  if value is None:
    raise CheckpointError(f"{path}: metadata has no '{NAME}.{key}', which a gemma4 model needs")
  return value


def _per_layer(meta: Mapping[str, Any], path: str, key: str, layers: int) -> tuple[int, ...]:
  """A LAYER_ARRAYS key's per-layer values, or () when the file gives one value."""
  value = meta.get(f"{NAME}.{key}")
  if not isinstance(value, list | tuple):
    return ()
  if len(value) != layers:
    raise CheckpointError(f"{path}: {NAME}.{key} has {len(value)} entries for {layers} layers")
  return tuple(int(v) for v in value)


def _local_layers(meta: Mapping[str, Any], path: str, layers: int) -> tuple[bool, ...]:
  key = "attention.sliding_window_pattern"
  pattern = _required(meta, path, key)
  if not isinstance(pattern, list | tuple) or len(pattern) != layers:
    raise CheckpointError(
      f"{path}: {NAME}.{key} must be one bool per layer ({layers}), got {pattern!r}"
    )
  return tuple(bool(p) for p in pattern)


def _shared_kv(meta: Mapping[str, Any], path: str, local: tuple[bool, ...]) -> int:
  """`attention.shared_kv_layers`, checked as llama.cpp's KV reuse needs it: at least two layers
  compute KV, and each sharing layer's source (`kv_layers - 2` local, `- 1` global) is of its
  kind."""
  key = f"{NAME}.attention.shared_kv_layers"
  shared, layers = int(meta.get(key, 0)), len(local)
  if not shared:
    return 0
  own = layers - shared
  if shared < 0 or own < 2:
    raise CheckpointError(f"{path}: {key} {shared} of {layers} layers: two must compute KV")
  for i in range(own, layers):
    source = own - (2 if local[i] else 1)
    if local[source] != local[i]:
      raise CheckpointError(
        f"{path}: {key} {shared}: layer {i} would reuse the KV of layer {source}, a layer of"
        " another kind (sliding_window_pattern)"
      )
  return shared


def _kv_heads(
  meta: Mapping[str, Any], path: str, local: tuple[bool, ...], own: int
) -> tuple[int, ...]:
  """Per-layer KV heads, one value per kind among the layers that compute KV (one cache each)."""
  values = _per_layer(meta, path, "attention.head_count_kv", len(local))
  for kind in (True, False):
    seen = {values[i] for i in range(own) if local[i] == kind} if values else set()
    if len(seen) > 1:
      raise CheckpointError(
        f"{path}: {NAME}.attention.head_count_kv gives the {'local' if kind else 'global'}"
        f" layers different KV heads {sorted(seen)}; one per kind is supported"
      )
  return values


def _experts(meta: Mapping[str, Any], path: str, tensors: Mapping[str, Any]) -> dict[str, Any]:
  """The expert fields (none without `expert_count`), checked as llama.cpp's loader checks
  them."""
  experts = int(meta.get(f"{NAME}.expert_count", 0))
  used = meta.get(f"{NAME}.expert_used_count", 0)
  if isinstance(used, list | tuple):
    raise CheckpointError(f"{path}: per-layer values of '{NAME}.expert_used_count': {used}")
  if experts <= 0:
    return {}
  if not 1 <= int(used) <= experts:
    raise CheckpointError(
      f"{path}: {NAME}.expert_used_count {used} must be in [1, {NAME}.expert_count {experts}]"
    )
  ffn = _required(meta, path, "expert_feed_forward_length")
  if isinstance(ffn, list | tuple):
    raise CheckpointError(f"{path}: per-layer values of '{NAME}.expert_feed_forward_length'")
  return dict(
    experts=experts,
    experts_used=int(used),
    expert_ffn=int(ffn),
    expert_gating="softmax",
    expert_weights_norm=True,
    expert_fused_gate_up="blk.0.ffn_gate_up_exps.weight" in tensors,
    expert_dense_branch=True,
    expert_router_norm=True,
    expert_down_scale="blk.0.ffn_down_exps.scale" in tensors,
  )


def gemma4_fields(
  meta: Mapping[str, Any], path: str, c: dict[str, Any], tensors: Mapping[str, Any]
) -> dict[str, Any]:
  """The gemma4 fields of a `TransformerConfig`, given the fields every arch reads (`c`: dim,
  layers, heads, head_dim, rope_base, ...) and the file's tensor names.

  Raises:
    CheckpointError naming the key (or tensor): a required key missing, a sliding-window
      pattern that is not one bool per layer, a local head width whose key and value lengths or
      rotary dims differ, shared-KV layers llama.cpp cannot reuse, KV heads that differ within a
      kind, a fused attn_qkv, experts used outside [1, expert_count], experts without their
      width.
  """
  layers = c["layers"]
  if "blk.0.attn_qkv.weight" in tensors:
    raise CheckpointError(
      f"{path}: 'blk.0.attn_qkv.weight': fused q|k|v is not supported for gemma4"
    )
  local = _local_layers(meta, path, layers)
  head_local = int(_required(meta, path, "attention.key_length_swa"))
  value_local = int(_required(meta, path, "attention.value_length_swa"))
  if value_local != head_local:
    raise CheckpointError(
      f"{path}: {NAME}.attention.value_length_swa {value_local} differs from key_length_swa"
      f" {head_local}"
    )
  rot_local = int(meta.get(f"{NAME}.rope.dimension_count_swa", c["head_dim"]))
  if any(local) and rot_local != head_local:
    raise CheckpointError(
      f"{path}: partial rotary embeddings ({NAME}.rope.dimension_count_swa {rot_local} of the"
      f" local head dim {head_local}) are not supported"
    )
  shared = _shared_kv(meta, path, local)
  own = layers - shared
  return dict(
    sliding_window=int(_required(meta, path, "attention.sliding_window")),
    local_layers=local,
    head_dim_local=head_local if head_local != c["head_dim"] else 0,
    layer_kv_heads=_kv_heads(meta, path, local, own),
    layer_ffn=_per_layer(meta, path, "feed_forward_length", layers),
    layer_k_as_v=tuple(i < own and f"blk.{i}.attn_v.weight" not in tensors for i in range(layers)),
    shared_kv_layers=shared,
    per_layer_dim=int(_required(meta, path, "embedding_length_per_layer_input")),
    layer_out_scale="blk.0.layer_output_scale.weight" in tensors,
    rope_freq_factors=not all(local),
    rope_base_local=float(meta.get(f"{NAME}.rope.freq_base_swa", 10000.0)),
    final_softcap=float(meta.get(f"{NAME}.final_logit_softcapping", DEFAULT_FINAL_SOFTCAP)),
    attn_scale=1.0,
    v_norm=True,
    scan_layers=False,
    **_experts(meta, path, tensors),
  )


ARCH = Arch(
  NAME,
  dict(GEMMA_FIELDS, post_norms=True, qk_norm=True),
  layer_arrays=LAYER_ARRAYS,
  read=gemma4_fields,
)
"""Gemma 4 as `q8rules.llm.archs.ARCHS` holds it: gemma3's norms and QK-norm, the rest read by
`gemma4_fields`."""

__all__ = ["ARCH", "DEFAULT_FINAL_SOFTCAP", "LAYER_ARRAYS", "NAME", "gemma4_fields"]
