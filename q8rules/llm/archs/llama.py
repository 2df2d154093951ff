"""The `llama` arch (Llama 2 / 3 / 3.1+, TinyLlama, Mistral-style; Mixtral-style experts), as
llama.cpp reads it (src/models/llama.cpp).

llama.cpp's converter permutes llama's q / k rows for ggml's NORM rope: interleaved pairs. A file
may have `rope_freqs` (Llama 3.1+'s scaling, dividing each pair's frequency), or with
`rope.scaling.type` longrope the LongRoPE factors `rope_factors_long` / `_short`; and with
`expert_count` > 0, experts in place of the FFN (`ffn_gate_inp`, `ffn_*_exps`), softmax gating,
the chosen weights normalised, each expert `feed_forward_length` wide.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from q8rules.llm.arch import Arch, MoeArch


def rope_factors(
  meta: Mapping[str, Any], path: str, c: dict[str, Any], tensors: Mapping[str, Any]
) -> dict[str, Any]:
  """The rope factor tensors llama.cpp reads for llama: `rope_freqs` by presence, or in
  longrope the long / short factors by presence."""
  if c["rope_scaling"] == "longrope":
    return {"rope_long_short": "rope_factors_long.weight" in tensors}
  return {"rope_freq_factors": "rope_freqs.weight" in tensors}


ARCH = Arch(
  "llama",
  dict(rope_style="interleaved"),
  experts=MoeArch(own_ffn=False, required=False),
  read=rope_factors,
)
"""llama as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "rope_factors"]
