"""A GGUF file's mixture-of-experts keys as `TransformerConfig` fields, as llama.cpp reads them.

llama.cpp's loader (src/llama-model.cpp) reads `{arch}.expert_count` and
`{arch}.expert_used_count` for every arch (absent: 0), and each arch's graph fixes the rest
(src/models/<arch>.cpp): how the router's logits become weights and whether the chosen
weights are normalised. An arch declares that (`q8rules.llm.arch.MoeArch`, its `Arch.experts`);
`expert_fields` reads a file's keys into the config's expert fields, refusing what llama.cpp
would abort on with a `CheckpointError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from q8rules.checkpoint import CheckpointError
from q8rules.llm.arch import MoeArch
from q8rules.models.config import EXPERT_GATINGS

EXPERT_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""The GGUF names (in blk.N) of a layer's router and expert stacks."""


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


__all__ = ["EXPERT_TENSORS", "expert_fields"]
