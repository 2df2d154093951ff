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

from collections.abc import Mapping
from typing import Any

from q8rules.llm.arch import Arch, SlidingWindow
from q8rules.llm.archs.gemma import GEMMA_FIELDS, large_model_scale

NAME = "gemma2"


def softcaps(
  meta: Mapping[str, Any], path: str, c: dict[str, Any], tensors: Mapping[str, Any]
) -> dict[str, Any]:
  """The soft-capping of the scores and logits, and the 27B model's attention scale."""
  return dict(
    attn_softcap=float(meta.get(f"{NAME}.attn_logit_softcapping", 50.0)),
    final_softcap=float(meta.get(f"{NAME}.final_logit_softcapping", 30.0)),
    **large_model_scale(c, 46),
  )


ARCH = Arch(
  NAME,
  dict(GEMMA_FIELDS, tied_embeddings=True, post_norms=True),
  sliding_window=SlidingWindow(4096, 2, shared_rope=True),
  read=softcaps,
)
"""gemma2 as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "NAME", "softcaps"]
