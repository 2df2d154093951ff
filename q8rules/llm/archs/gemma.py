"""The `gemma` arch (Gemma), as llama.cpp reads it (src/models/gemma.cpp): NEOX rope, the
embeddings times sqrt(dim), a GELU-tanh GeGLU, always tied embeddings; the norm weights as
stored (the converter stores 1 + w). gemma2, gemma3 and gemma4 start from its fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from q8rules.llm.arch import Arch, ReadFields

GEMMA_FIELDS: dict[str, Any] = dict(rope_style="halves", embed_scale=True, activation="gelu_tanh")
"""The config fields every Gemma's graph fixes."""


def softcaps(name: str, final: float, layers_27b: int, attn: float | None = None) -> ReadFields:
  """The `Arch.read` of a Gemma with soft-capping: the final logits' (`final_logit_softcapping`,
  default `final`; 0: off) and with `attn` the scores' (`attn_logit_softcapping`, default
  `attn`); and the attention scale of the 27B model (its `layers_27b` layers), where llama.cpp
  takes 1 / sqrt(dim / heads) (gemma_pytorch's query_pre_attn_scalar) instead of 1 /
  sqrt(head_dim)."""

  def read(
    meta: Mapping[str, Any], path: str, c: dict[str, Any], tensors: Mapping[str, Any]
  ) -> dict[str, Any]:
    out = {"final_softcap": float(meta.get(f"{name}.final_logit_softcapping", final))}
    if attn is not None:
      out["attn_softcap"] = float(meta.get(f"{name}.attn_logit_softcapping", attn))
    if c["layers"] == layers_27b:
      out["attn_scale"] = 1.0 / math.sqrt(c["dim"] / c["heads"])
    return out

  return read


ARCH = Arch("gemma", dict(GEMMA_FIELDS, tied_embeddings=True))
"""gemma as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "GEMMA_FIELDS", "softcaps"]
