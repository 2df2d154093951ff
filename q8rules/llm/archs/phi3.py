"""The `phi3` arch (Phi-3 / Phi-3.5, full rotary), as llama.cpp reads it (src/models/phi3.cpp):
NEOX rope; q | k | v as one `attn_qkv` matrix and gate | up as one `ffn_up` (gate rows, then up
rows); LongRoPE factors `rope_factors_long` / `_short` by presence, chosen by the context; a
`sliding_window` key is not read, as llama.cpp does not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from q8rules.llm.arch import Arch


def rope_factors(
  meta: Mapping[str, Any], path: str, c: dict[str, Any], tensors: Mapping[str, Any]
) -> dict[str, Any]:
  """The LongRoPE factors, by presence of `rope_factors_long`."""
  return {"rope_long_short": "rope_factors_long.weight" in tensors}


ARCH = Arch(
  "phi3",
  dict(rope_style="halves", fused_qkv=True, fused_gate_up=True),
  read=rope_factors,
)
"""phi3 as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "rope_factors"]
