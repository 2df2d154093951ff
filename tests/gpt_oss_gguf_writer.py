"""A small gpt-oss GGUF file (llama.cpp's openai-moe) written with gguf-py's GGUFWriter alone,
independently of scripts/: the keys and tensor layout llama.cpp's converter writes for
OpenAI's gpt-oss (convert_hf_to_gguf.py's `GptOssModel`: conversion/gpt_oss.py and
`TextModel.set_gguf_parameters`), with random float32 weights.

What the converter writes, and so this file: no `rope.dimension_count` (llama.cpp takes the
key length); `attention.key_length` / `value_length` from HF's `head_dim`, which need not be
`embedding_length / head_count` (gpt-oss-20b: 64 heads of 64 over 2880); YaRN as
`rope.scaling.type` 'yarn', `factor`, `original_context_length` and HF's `beta_fast` /
`beta_slow` as `rope.scaling.yarn_beta_fast` / `_slow`; `attention.sliding_window`
(llama.cpp's pattern: even layers local); `expert_feed_forward_length`. Tensors (GGUF numpy
order, [n_out, n_in]; expert stacks [E, n_out, n_in], their biases [E, n_out]): q, k, v and
the output projection with biases, `attn_sinks.weight` (one logit per head), the FFN's norm
as `post_attention_norm`, a router with a bias, gate / up / down experts with biases, an
untied `output`. The vocab is byte-level BPE (gpt2): the 256 byte symbols and a few merges;
the tests feed token ids.

`Spec` sets the sizes and lets a piece be changed (YaRN off, sinks and biases zero, one
window wide enough to cover every position), to find which piece a reader gets wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import gguf
import numpy as np

ARCH = "gpt-oss"


@dataclasses.dataclass(frozen=True)
class Spec:
  """The file's sizes and pieces (defaults: n_head * head_dim = 96 != n_embd = 64)."""

  dim: int = 64
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 24
  layers: int = 4
  experts: int = 4
  experts_used: int = 2
  expert_ffn: int = 48
  merges: int = 44
  ctx: int = 131072
  rope_base: float = 150000.0
  yarn: bool = True
  yarn_factor: float = 32.0
  orig_ctx: int = 4096
  window: int = 8
  sinks: float = 1.0
  """Scale of the sink logits (0: every sink logit 0, not absent: llama.cpp requires them)."""
  biases: float = 0.1
  """Scale of every bias (0: all zero)."""
  eps: float = 1e-5
  seed: int = 0

  @property
  def vocab(self) -> int:
    return 256 + self.merges


def byte_symbols() -> list[str]:
  """GPT-2's printable stand-ins for the 256 bytes (`bytes_to_unicode`), in byte order."""
  keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  extra = iter(range(256, 512))
  return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def vocab(spec: Spec) -> tuple[list[str], list[str]]:
  """(tokens, merges): the byte symbols, then one token per merge of two lowercase letters."""
  symbols = byte_symbols()
  letters = "etaoinshrdlu"
  pairs = [(a, b) for a in letters for b in letters][: spec.merges]
  if len(pairs) < spec.merges:
    raise ValueError(f"at most {len(letters) ** 2} merges, got {spec.merges}")
  return symbols + [a + b for a, b in pairs], [f"{a} {b}" for a, b in pairs]


def weights(spec: Spec) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF numpy order ([n_out, n_in]; experts [E, n_out, n_in])."""
  s = spec
  rng = np.random.default_rng(s.seed)
  q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim

  def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

  def bias(*shape: int) -> np.ndarray:
    return (s.biases * rng.standard_normal(shape)).astype(np.float32)

  def norm(n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  w = {"token_embd.weight": rng.standard_normal((s.vocab, s.dim)).astype(np.float32)}
  for i in range(s.layers):
    p = f"blk.{i}."
    w[p + "attn_norm.weight"] = norm(s.dim)
    for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
      w[p + f"attn_{name}.weight"] = mat(rows, s.dim, gain=1.5)
      w[p + f"attn_{name}.bias"] = bias(rows)
    w[p + "attn_output.weight"] = mat(s.dim, q_rows)
    w[p + "attn_output.bias"] = bias(s.dim)
    w[p + "attn_sinks.weight"] = (s.sinks * rng.standard_normal(s.heads)).astype(np.float32)
    w[p + "post_attention_norm.weight"] = norm(s.dim)
    w[p + "ffn_gate_inp.weight"] = mat(s.experts, s.dim, gain=2.0)
    w[p + "ffn_gate_inp.bias"] = bias(s.experts)
    # gains that take gate and up past the activation's clamp (7) now and then
    for name, shape, gain in (
      ("gate", (s.expert_ffn, s.dim), 3.0),
      ("up", (s.expert_ffn, s.dim), 3.0),
      ("down", (s.dim, s.expert_ffn), 0.5),
    ):
      w[p + f"ffn_{name}_exps.weight"] = mat(s.experts, *shape, gain=gain)
      w[p + f"ffn_{name}_exps.bias"] = bias(s.experts, shape[0])
  w["output_norm.weight"] = norm(s.dim)
  w["output.weight"] = mat(s.vocab, s.dim, gain=4.0)
  return w


def weights_sha256(weights: dict[str, np.ndarray]) -> str:
  """sha256 over `weights`' names, shapes and float32 bytes, in their order: what a reference
  made from these weights records, to tell when the writer has changed them."""
  h = hashlib.sha256()
  for name, array in weights.items():
    h.update(f"{name}{array.shape}".encode())
    h.update(np.ascontiguousarray(array, np.float32).tobytes())
  return h.hexdigest()


def write(path: Path, spec: Spec = Spec()) -> Path:
  """The F32 file of `spec` at `path` (returned), with the converter's keys."""
  s = spec
  tokens, merges = vocab(s)
  writer = gguf.GGUFWriter(path, ARCH)
  writer.add_name("independent-tiny-gpt-oss")
  writer.add_block_count(s.layers)
  writer.add_context_length(s.ctx)
  writer.add_embedding_length(s.dim)
  writer.add_feed_forward_length(s.expert_ffn)  # HF's intermediate_size
  writer.add_head_count(s.heads)
  writer.add_head_count_kv(s.kv_heads)
  if s.yarn:
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(s.yarn_factor)
    writer.add_rope_scaling_orig_ctx_len(s.orig_ctx)
    writer.add_rope_scaling_yarn_beta_fast(32.0)
    writer.add_rope_scaling_yarn_beta_slow(1.0)
  writer.add_rope_freq_base(s.rope_base)
  writer.add_layer_norm_rms_eps(s.eps)
  writer.add_expert_count(s.experts)
  writer.add_expert_used_count(s.experts_used)
  writer.add_key_length(s.head_dim)
  writer.add_value_length(s.head_dim)
  writer.add_file_type(gguf.LlamaFileType.ALL_F32)
  writer.add_sliding_window(s.window)
  writer.add_expert_feed_forward_length(s.expert_ffn)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
  writer.add_token_merges(merges)
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(1)
  writer.add_add_bos_token(False)
  for name, array in weights(s).items():
    writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def prompt(spec: Spec, n: int = 24, seed: int = 1) -> list[int]:
  """`n` token ids drawn from the vocab (fixed seed)."""
  return np.random.default_rng(seed).integers(0, spec.vocab, n).tolist()


__all__ = ["ARCH", "Spec", "prompt", "vocab", "weights", "weights_sha256", "write"]
