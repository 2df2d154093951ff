"""GGUF files of real MoE models' layer shapes, with random quantized blocks, for the MoE
decode benchmark (`bench_moe_gguf.py`).

No real MoE file fits this machine's 24 GiB with room for two runtimes, so these keep the real
layer shapes (`QWEN3_30B_A3B`, `GPT_OSS_20B`) and the real tokenizer (llama.cpp's
`ggml-vocab-qwen2.gguf`: Qwen's 151,936 tokens) with fewer layers. Weights are random valid
blocks written straight to disk, one tensor at a time (no float weights are ever made):
Q8_0 (float16 scale, int8 values) for the matrices, MXFP4 (E8M0 scale, 32 E2M1 codes) for
gpt-oss's experts as its files store them, float32 for norms, biases, routers and sinks.

Tensor names and numpy shapes are llama.cpp's (src/models/qwen3moe.cpp, openai-moe.cpp):
a matrix is `[n_out, n_in]`, an expert stack `[n_expert, n_out, n_in]`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

VOCAB_FILE = Path.home() / ".cache/q8rules/llama-vocabs/ggml-vocab-qwen2.gguf"
"""llama.cpp's Qwen 2 vocab test file (scripts/fetch_llama_vocabs.py caches it)."""


@dataclasses.dataclass(frozen=True)
class MoeShape:
  """One MoE decoder's shapes, in llama.cpp's hyperparameter names.

  Attributes:
    arch: `general.architecture` ('qwen3moe' or 'gpt-oss').
    dim: n_embd.
    heads, kv_heads, head_dim: attention heads, KV heads, per-head width.
    experts, used: n_expert and n_expert_used (top k).
    expert_ffn: each expert's FFN width (n_ff_exp).
    layers: blocks written (the real model has more: see `real_layers`).
    real_layers: the real model's depth.
    expert_type: 'Q8_0' or 'MXFP4', how the expert stacks are stored.
  """

  arch: str
  dim: int
  heads: int
  kv_heads: int
  head_dim: int
  experts: int
  used: int
  expert_ffn: int
  layers: int
  real_layers: int
  expert_type: str = "Q8_0"

  def tensors(self, vocab: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (storage 'F32' / 'Q8_0' / 'MXFP4', numpy shape), in file order."""
    d, e, f = self.dim, self.experts, self.expert_ffn
    q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
    out: dict[str, tuple[str, tuple[int, ...]]] = {"token_embd.weight": ("Q8_0", (vocab, d))}
    gpt_oss = self.arch == "gpt-oss"
    for i in range(self.layers):
      b = f"blk.{i}."
      out[b + "attn_norm.weight"] = ("F32", (d,))
      for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
        out[b + name + ".weight"] = ("Q8_0", (n, d))
        if gpt_oss:
          out[b + name + ".bias"] = ("F32", (n,))
      out[b + "attn_output.weight"] = ("Q8_0", (d, q))
      if gpt_oss:
        out[b + "attn_output.bias"] = ("F32", (d,))
        out[b + "attn_sinks.weight"] = ("F32", (self.heads,))
        out[b + "post_attention_norm.weight"] = ("F32", (d,))
      else:
        out[b + "attn_q_norm.weight"] = ("F32", (self.head_dim,))
        out[b + "attn_k_norm.weight"] = ("F32", (self.head_dim,))
        out[b + "ffn_norm.weight"] = ("F32", (d,))
      out[b + "ffn_gate_inp.weight"] = ("F32", (e, d))
      if gpt_oss:
        out[b + "ffn_gate_inp.bias"] = ("F32", (e,))
      for name, n_out, n_in in (("gate", f, d), ("up", f, d), ("down", d, f)):
        out[b + f"ffn_{name}_exps.weight"] = (self.expert_type, (e, n_out, n_in))
        if gpt_oss:
          out[b + f"ffn_{name}_exps.bias"] = ("F32", (e, n_out))
    out["output_norm.weight"] = ("F32", (d,))
    out["output.weight"] = ("Q8_0", (vocab, d))
    return out

  def routed_bytes(self, vocab: int) -> int:
    """Bytes a decode step reads: every tensor but the expert stacks, plus `used` experts
    of each stack, plus one row of the embedding table (a lookup, not the table)."""
    total = 0
    for name, (kind, shape) in self.tensors(vocab).items():
      size = nbytes(kind, shape)
      if name == "token_embd.weight":
        size //= shape[0]
      elif "_exps.weight" in name:
        size = size // shape[0] * self.used
      total += size
    return total


QWEN3_30B_A3B = MoeShape(
  "qwen3moe", dim=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8,
  expert_ffn=768, layers=8, real_layers=48,
)  # fmt: skip
"""Qwen3-30B-A3B's layer (its config.json), 8 of its 48 layers."""

GPT_OSS_20B = MoeShape(
  "gpt-oss", dim=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4,
  expert_ffn=2880, layers=4, real_layers=24, expert_type="MXFP4",
)  # fmt: skip
"""gpt-oss-20b's layer (its config.json), 4 of its 24 layers, experts MXFP4."""

BLOCK_BYTES = {"Q8_0": 34, "MXFP4": 17}
"""Bytes per block of 32 weights."""


def nbytes(kind: str, shape: tuple[int, ...]) -> int:
  """Bytes of a tensor stored as `kind` ('F32', 'Q8_0', 'MXFP4')."""
  n = int(np.prod(shape))
  return n * 4 if kind == "F32" else n // 32 * BLOCK_BYTES[kind]


def _random_blocks(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  """Random valid blocks of `shape`, as uint8 rows (..., n_in / 32 * block bytes), weights of
  about 0.02 / sqrt(n_in / 2048) in magnitude."""
  n_in = shape[-1]
  blocks = int(np.prod(shape)) // 32
  gain = 0.02 / np.sqrt(n_in / 2048)
  if kind == "Q8_0":
    b = np.empty(blocks, np.dtype([("d", "<f2"), ("qs", "i1", (32,))]))
    b["qs"] = rng.integers(-127, 128, b["qs"].shape, dtype=np.int8)
    b["d"] = (rng.uniform(0.5, 1.5, blocks) * gain / 127).astype(np.float16)
  else:  # MXFP4: E8M0 exponent e (scale 2^(e - 128) on ggml's doubled E2M1 values), 16 bytes
    b = np.empty(blocks, np.dtype([("e", "u1"), ("qs", "u1", (16,))]))
    b["qs"] = rng.integers(0, 256, b["qs"].shape, dtype=np.uint8)
    b["e"] = np.round(128 + np.log2(gain / 6) + rng.uniform(-0.5, 0.5, blocks)).astype(np.uint8)
  return b.view(np.uint8).reshape(*shape[:-1], -1)


def _copy_vocab(writer, arch: str) -> int:
  """Copy the tokenizer of `VOCAB_FILE` into `writer`; returns the vocab size."""
  import gguf

  if not VOCAB_FILE.exists():
    raise SystemExit(f"{VOCAB_FILE} is missing: run scripts/fetch_llama_vocabs.py")
  vocab = gguf.GGUFReader(VOCAB_FILE)
  size = 0
  for key, field in vocab.fields.items():
    if not key.startswith("tokenizer."):
      continue
    vt = gguf.GGUFValueType(field.types[0])
    sub = gguf.GGUFValueType(field.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
    value = field.contents()
    if key == "tokenizer.ggml.tokens":
      size = len(value)
    writer.add_key_value(key, value, vt, sub)
  return size


def _metadata(writer, shape: MoeShape) -> None:
  a = shape.arch
  u32, f32 = "add_uint32", "add_float32"
  keys = {
    "context_length": (u32, 4096),
    "embedding_length": (u32, shape.dim),
    "block_count": (u32, shape.layers),
    "feed_forward_length": (u32, shape.expert_ffn),
    "expert_feed_forward_length": (u32, shape.expert_ffn),
    "attention.head_count": (u32, shape.heads),
    "attention.head_count_kv": (u32, shape.kv_heads),
    "attention.key_length": (u32, shape.head_dim),
    "attention.value_length": (u32, shape.head_dim),
    "rope.dimension_count": (u32, shape.head_dim),
    "expert_count": (u32, shape.experts),
    "expert_used_count": (u32, shape.used),
    "attention.layer_norm_rms_epsilon": (f32, 1e-6 if a == "qwen3moe" else 1e-5),
    "rope.freq_base": (f32, 1e6 if a == "qwen3moe" else 150000.0),
  }
  if a == "gpt-oss":  # gpt-oss-20b's GGUF: 128-token windows on every other layer, YaRN x32
    keys |= {
      "attention.sliding_window": (u32, 128),
      "rope.scaling.factor": (f32, 32.0),
      "rope.scaling.original_context_length": (u32, 4096),
    }
    writer.add_string(f"{a}.rope.scaling.type", "yarn")
  for key, (method, value) in keys.items():
    getattr(writer, method)(f"{a}.{key}", value)


def make_file(path: Path, shape: MoeShape, seed: int = 0) -> None:
  """Write `shape` as a GGUF at `path` (through a temporary file, renamed when complete)."""
  import gguf

  rng = np.random.default_rng(seed)
  tmp = path.with_suffix(".tmp")
  w = gguf.GGUFWriter(tmp, shape.arch)
  vocab = _copy_vocab(w, shape.arch)
  _metadata(w, shape)
  types = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "MXFP4": gguf.GGMLQuantizationType.MXFP4}
  tensors = shape.tensors(vocab)
  for name, (kind, shp) in tensors.items():
    if kind == "F32":
      w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes(kind, shp))
    else:
      stored = (*shp[:-1], shp[-1] // 32 * BLOCK_BYTES[kind])
      w.add_tensor_info(name, stored, np.dtype(np.uint8), nbytes(kind, shp), raw_dtype=types[kind])
  w.write_header_to_file(tmp)
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  for name, (kind, shp) in tensors.items():
    if kind != "F32":
      w.write_tensor_data(_random_blocks(kind, shp, rng))
    elif name.endswith("norm.weight"):
      w.write_tensor_data(rng.uniform(0.8, 1.2, shp).astype(np.float32))
    else:  # routers, biases and sinks
      w.write_tensor_data(rng.normal(0.0, 0.5, shp).astype(np.float32))
  w.close()
  os.replace(tmp, path)


__all__ = ["GPT_OSS_20B", "MoeShape", "QWEN3_30B_A3B", "make_file", "nbytes"]
