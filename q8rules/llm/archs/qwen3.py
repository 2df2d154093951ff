"""The `qwen3` arch (Qwen 3, dense), as llama.cpp reads it (src/models/qwen3.cpp): NEOX rope,
QK-norm (per-head RMS norm of q and k before rope: `attn_q_norm`, `attn_k_norm`); its
`attention.key_length` may differ from dim / heads (read as every arch's)."""

from __future__ import annotations

from q8rules.llm.arch import Arch

FIELDS = dict(rope_style="halves", qk_norm=True)
"""The config fields qwen3's graph fixes (qwen3moe's too)."""

ARCH = Arch("qwen3", FIELDS)
"""qwen3 as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "FIELDS"]
