"""The GGUF architectures `load_gguf` runs: one module each, registered in `ARCHS`.

Each module builds one `q8rules.llm.arch.Arch` (its `ARCH`): the config fields its llama.cpp
graph fixes, the keys it reads besides the ones every arch has, its checks and its tensors'
names where they differ from the generic table's. Adding an arch is one module here, its line
in `ARCHS` and its tests (docs/archs.md, "Adding an arch").

  llama.py     interleaved rope, `rope_freqs`, Mixtral-style experts
  qwen2.py     q, k, v biases
  qwen3.py     QK-norm
  qwen3moe.py  qwen3 with experts
  gemma.py     Gemma's embeddings scale, GeGLU, tied output (gemma2-4 start from it)
  gemma2.py    post-norms, soft-capping, sliding window
  gemma3.py    QK-norm, 5 of 6 layers local
  gemma4.py    per-kind head widths, per-layer embeddings, shared KV, experts beside the FFN
  phi3.py      fused q|k|v and gate|up, LongRoPE
  gpt_oss.py   sinks, YaRN, biased experts, its FFN norm's name
"""

from __future__ import annotations

from q8rules.llm.arch import Arch
from q8rules.llm.archs import (
  gemma,
  gemma2,
  gemma3,
  gemma4,
  gpt_oss,
  llama,
  phi3,
  qwen2,
  qwen3,
  qwen3moe,
)

ARCHS: dict[str, Arch] = {
  a.name: a
  for a in (
    llama.ARCH,
    qwen2.ARCH,
    qwen3.ARCH,
    qwen3moe.ARCH,
    gemma.ARCH,
    gemma2.ARCH,
    gemma3.ARCH,
    phi3.ARCH,
    gpt_oss.ARCH,
    gemma4.ARCH,
  )
}
"""`general.architecture` -> its `Arch`, for every arch `load_gguf` runs."""

__all__ = ["ARCHS", "Arch"]
