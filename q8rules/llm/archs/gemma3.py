"""The `gemma3` arch (Gemma 3, text), as llama.cpp reads it (src/models/gemma3-iswa.cpp): gemma2
without attention soft-capping, with QK-norm and an optional untied output, and besides the keys
every arch has:

  attention.sliding_window           default none: every layer global
  attention.sliding_window_pattern   default 6: 5 of every 6 layers local
  rope.freq_base_swa                 default 10000: the local layers' base (no rope scaling)
  final_logit_softcapping            default 0 (off)

The 27B model (62 layers) scales its scores by 1 / sqrt(dim / heads).
"""

from __future__ import annotations

from q8rules.llm.arch import Arch, SlidingWindow
from q8rules.llm.archs.gemma import GEMMA_FIELDS, softcaps

NAME = "gemma3"

ARCH = Arch(
  NAME,
  dict(GEMMA_FIELDS, post_norms=True, qk_norm=True),
  sliding_window=SlidingWindow(None, 6),
  read=softcaps(NAME, final=0.0, layers_27b=62),
)
"""gemma3 as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "NAME"]
