"""The `gemma` arch (Gemma), as llama.cpp reads it (src/models/gemma.cpp): NEOX rope, the
embeddings times sqrt(dim), a GELU-tanh GeGLU, always tied embeddings; the norm weights as
stored (the converter stores 1 + w). gemma2, gemma3 and gemma4 start from its fields.
"""

from __future__ import annotations

import math
from typing import Any

from q8rules.llm.arch import Arch

GEMMA_FIELDS: dict[str, Any] = dict(rope_style="halves", embed_scale=True, activation="gelu_tanh")
"""The config fields every Gemma's graph fixes."""


def large_model_scale(c: dict[str, Any], layers_27b: int) -> dict[str, Any]:
  """The 27B model's attention scale (its `layers_27b` layers): llama.cpp takes 1 /
  sqrt(dim / heads) there (gemma_pytorch's query_pre_attn_scalar) instead of 1 /
  sqrt(head_dim); {} for the other sizes."""
  if c["layers"] != layers_27b:
    return {}
  return {"attn_scale": 1.0 / math.sqrt(c["dim"] / c["heads"])}


ARCH = Arch("gemma", dict(GEMMA_FIELDS, tied_embeddings=True))
"""gemma as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "GEMMA_FIELDS", "large_model_scale"]
