"""The `qwen2` arch (Qwen 2 / 2.5), as llama.cpp reads it (src/models/qwen2.cpp): HF's q / k
order with NEOX rope (halves), biases on q, k and v (`attn_q.bias`, `attn_k.bias`,
`attn_v.bias`); nothing read besides the keys every arch has."""

from __future__ import annotations

from q8rules.llm.arch import Arch

ARCH = Arch("qwen2", dict(rope_style="halves", qkv_bias=True))
"""qwen2 as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH"]
