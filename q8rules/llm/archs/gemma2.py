"""The `gemma2` arch (Gemma 2), as llama.cpp reads it (src/models/gemma2-iswa.cpp): gemma with
post-attention and post-FFN norms, always tied embeddings, and besides the keys every arch has:

  attention.sliding_window           default 4096; the local layers' window
  attention.sliding_window_pattern   default 2: layers 0, 2, 4, ... local (same rope base and
                                     scale as the global ones)
  attn_logit_softcapping             default 50
  final_logit_softcapping            default 30

The 27B model (46 layers) scales its scores by 1 / sqrt(dim / heads).
"""

from __future__ import annotations

from q8rules.llm.arch import Arch, SlidingWindow
from q8rules.llm.archs.gemma import GEMMA_FIELDS, softcaps

NAME = "gemma2"

ARCH = Arch(
  NAME,
  dict(GEMMA_FIELDS, tied_embeddings=True, post_norms=True),
  sliding_window=SlidingWindow(4096, 2, shared_rope=True),
  read=softcaps(NAME, final=30.0, layers_27b=46, attn=50.0),
)
"""gemma2 as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "NAME"]
