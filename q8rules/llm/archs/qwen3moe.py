"""The `qwen3moe` arch (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B), as llama.cpp reads
it (src/models/qwen3moe.cpp): qwen3 with experts in place of the FFN, always: softmax over the
router's logits, the top `expert_used_count`, the chosen weights normalised; the experts
`expert_feed_forward_length` wide (absent: `feed_forward_length` / `expert_used_count`; the key
itself optional, llama.cpp's 0)."""

from __future__ import annotations

from q8rules.llm.arch import Arch, MoeArch
from q8rules.llm.archs.qwen3 import FIELDS

ARCH = Arch("qwen3moe", FIELDS, experts=MoeArch())
"""qwen3moe as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH"]
