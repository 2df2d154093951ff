"""A Gemma-4-E2B-shaped Q8_0 GGUF file for decode benchmarks: E2B's layer shapes and its real
262,144-token vocabulary (the tied head 1536 x 262,144, 0.43 GB of Q8_0 a decode step), with
fewer layers than its 35.

    python benchmarks/gemma4_file.py /tmp/bench-gemma4-e2b-5l.gguf [--layers 5]

The tensors and keys are scripts/gguf_gemma4.py's (llama.cpp's converter's layout, random
weights of its scales), at E2B's sizes: dim 1536, 8 heads, one KV head, head width 256 on the
local layers and 512 on the global ones, window 512, FFN 6144, per-layer inputs of 256, four
local layers to a global one; no KV-sharing layers (they would need 20 of the 35). The
vocabulary is Gemma 4's whole one (llama.cpp's ggml-vocab-gemma-4.gguf). Weights Q8_0 by
gguf-py's quantizer (llama.cpp's), `per_layer_model_proj` float as llama.cpp keeps it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

E2B = dict(
  dim=1536,
  heads=8,
  head_dim=512,
  head_dim_swa=256,
  window=512,
  rope_base=1e6,
  rope_base_swa=1e4,
  partial_rotary=0.25,
  eps=1e-6,
  ctx=4096,
  final_softcap=30.0,
  per_layer=256,
  shared_kv=0,
)
"""Gemma 4 E2B's sizes (its config.json / llama.cpp's header of it), per layer."""
VOCAB = 262144
"""Gemma 4's vocabulary."""


def config(layers: int) -> dict:
  """scripts/gguf_gemma4.py's config of an E2B-shaped model of `layers` layers (every fifth
  global)."""
  pattern = tuple((i + 1) % 5 != 0 for i in range(layers))
  return dict(E2B, layers=layers, pattern=pattern, kv_heads=(1,) * layers, ffn=(6144,) * layers)


def make_file(path: Path, layers: int = 5, seed: int = 0) -> None:
  """Write the Q8_0 file of `config(layers)` with Gemma 4's whole vocabulary to `path`."""
  import gguf_gemma4

  gguf_gemma4.VOCAB = VOCAB  # the module's tiny test files cut the vocabulary to 640 tokens
  cfg = config(layers)
  vocab = gguf_gemma4.gemma4_vocab()
  if len(vocab["tokens"]) != VOCAB:
    raise SystemExit(f"ggml-vocab-gemma-4.gguf has {len(vocab['tokens'])} tokens, not {VOCAB}")
  weights = gguf_gemma4.make_weights(cfg, seed)
  tmp = path.with_suffix(".tmp")
  gguf_gemma4.write(tmp, cfg, weights, vocab, q8=True)
  tmp.replace(path)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("path", type=Path)
  ap.add_argument("--layers", type=int, default=5)
  args = ap.parse_args()
  make_file(args.path, args.layers)


if __name__ == "__main__":
  main()
