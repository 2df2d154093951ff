"""The weight shapes the benchmarks time, named by model and layer.

A shape is (K, N): the product `x (m, K) @ W (K, N)`, K the layer's inputs and N its
outputs (GGUF stores the same weight as [N, K]). m, the rows of x, is each benchmark's own
choice (decode: 1-16 tokens; prefill: a prompt's length).

The models' sizes are those of their published configurations (Hugging Face `config.json`):

  Llama-3-8B      32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256
  Llama-3-70B     80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads, vocab 128256
  TinyLlama-1.1B  22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000

    from benchmarks.shapes import LLAMA3_8B, ISSUE_DECODE
    LLAMA3_8B.shape("down")   # (14336, 4096)
"""

from __future__ import annotations

import dataclasses

LAYERS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
"""A decoder's matrices: attention q, k, v, o; the gated MLP's gate, up, down; the output head."""


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A Llama-style decoder's sizes (grouped-query attention, gated MLP)."""

  name: str
  layers: int
  dim: int
  ffn: int
  heads: int
  kv_heads: int
  vocab: int

  @property
  def head_dim(self) -> int:
    return self.dim // self.heads

  def shape(self, layer: str) -> tuple[int, int]:
    """(K, N) of one of `LAYERS`' matrices, e.g. `shape("k")` == (dim, kv_heads * head_dim)."""
    kv = self.kv_heads * self.head_dim
    shapes = {
      "q": (self.dim, self.dim),
      "k": (self.dim, kv),
      "v": (self.dim, kv),
      "o": (self.dim, self.dim),
      "gate": (self.dim, self.ffn),
      "up": (self.dim, self.ffn),
      "down": (self.ffn, self.dim),
      "lm_head": (self.dim, self.vocab),
    }
    if layer not in shapes:
      raise KeyError(f"{self.name} has no layer {layer!r}; its layers are {', '.join(LAYERS)}")
    return shapes[layer]


LLAMA3_8B = Decoder(
  "Llama-3-8B", layers=32, dim=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256
)
LLAMA3_70B = Decoder(
  "Llama-3-70B", layers=80, dim=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256
)
TINYLLAMA_1B = Decoder(
  "TinyLlama-1.1B", layers=22, dim=2048, ffn=5632, heads=32, kv_heads=4, vocab=32000
)

ISSUE_DECODE: dict[str, tuple[int, int]] = {
  "Llama-3-8B q, o": LLAMA3_8B.shape("q"),
  "Llama-3-8B gate, up": LLAMA3_8B.shape("up"),
  "Llama-3-8B down": LLAMA3_8B.shape("down"),
  "Llama-3-70B gate, up": LLAMA3_70B.shape("up"),
  "Llama-3-8B lm_head": LLAMA3_8B.shape("lm_head"),
}
"""Five decode shapes of Llama-3-8B (the GPU check's decode rows)."""

ISSUE_PREFILL: tuple[str, tuple[int, int]] = ("Llama-3-8B gate, up", LLAMA3_8B.shape("up"))
"""A prefill shape of Llama-3-8B (the GPU check's prefill rows)."""

SQUARE: dict[str, tuple[int, int]] = {
  "Llama-3-8B q, o": LLAMA3_8B.shape("q"),
  "Llama-3-70B q, o": LLAMA3_70B.shape("q"),
}
"""The square (K = N) attention projections: the CPU tables' K = N rows."""

CPU_MATMUL: dict[str, tuple[int, int]] = {
  **SQUARE,
  "Llama-3-8B gate, up": LLAMA3_8B.shape("up"),
  "Llama-3-8B down": LLAMA3_8B.shape("down"),
}
"""The shapes of the CPU kernel against llama.cpp: the square ones and Llama-3-8B's MLP."""
