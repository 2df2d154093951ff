"""Write the small GGUF test models and llama.cpp's own outputs on them.

Run with a Python that has llama-cpp-python, gguf, numpy and tokenizers (not
the test environment; the tests only read what this writes):

    python scripts/make_gguf_references.py [--out tests/data/gguf_models] [--only NAME ...]

For each model of MODELS ('llama', 'qwen2', 'llama31', 'qwen3', 'gemma', 'gemma2',
'gemma3', 'phi3') it writes, from deterministic random weights:

  tiny-<name>-q8_0.gguf  weight matrices Q8_0 (gguf.quants, llama.cpp's
                         quantizer), norms, biases and rope factors F32;
  tiny-<name>-f32.gguf   the same weights, all F32;
  tiny-<name>.npz        llama.cpp's outputs (see `main` below); for the gemma archs
                         also its logits with every ffn_up zeroed (no GELU in the
                         graph: llama.cpp's CPU GELU reads a float16 table).

The files are laid out as llama.cpp's HF converter lays them out (its
conversion/<family>.py): weights `[n_out, n_in]`; for `llama` the rows of
attn_q / attn_k are permuted (`LlamaModel.permute`) from HF's rotate-half order
into the interleaved order of ggml's NORM rope; the other archs are not
permuted (NEOX rope); qwen2 has q/k/v biases and tied embeddings; llama31 has
Llama 3.1's `rope_freqs` (the converter's llama3 formula); qwen3 and gemma3
have per-head q/k norms; the gemma archs store every norm weight + 1 (HF's
(1 + w)), tie the embeddings, and gemma2/3 have post-attention / post-FFN
norms and sliding-window layers (window 8, shorter than the test sequence;
gemma3 with its 5-local-1-global pattern, a local rope base, and linear rope
scaling on the global layers only); gemma2 soft-caps attention scores and
logits; phi3 has fused attn_qkv and gate|up ffn_up, LongRoPE factors
(rope_factors_long / _short, original context 256 of 1024, with the
converter's attn_factor) and a sliding_window key that llama.cpp ignores.
The vocab is a byte-level BPE trained here with `tokenizers` on a fixed text,
stored as `tokenizer.ggml.*` (model 'gpt2').

Existing files are only rewritten when named with --only (the committed llama /
qwen2 references were made with an earlier llama.cpp).

'gpt-oss' (llama.cpp's openai-moe: sinks, biases, experts, YaRN, harmony) is written by
scripts/gguf_gpt_oss.py, with a third file llama.cpp quantizes to MXFP4 itself; its chat
template comes from llama-cpp-python's sdist (--sdist, else `pip download`ed).

'qwen3moe' and 'mixtral' (8 experts, top 2; arch `llama` with `ffn_*_exps` for the latter) are
written by scripts/gguf_moe.py, with a third file llama.cpp quantizes to Q4_K_M itself.

'gemma4-e2b', 'gemma4-31b' and 'gemma4-moe' (per-layer embeddings, shared KV, per-kind head
widths and KV heads, K as V, experts beside the dense FFN) are written by
scripts/gguf_gemma4.py with Gemma 4's own vocabulary and chat template, and a third file
llama.cpp quantizes to Q4_K_M itself.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import gguf
import gguf_gemma4
import gguf_gpt_oss
import gguf_moe
import numpy as np
from tiny_gguf_parts import (
  N_NEW,
  PROMPT,
  TOKENIZER_STRINGS,
  hf_to_gguf_permute,
  run_llama_cpp,
  train_vocab,
  write_tensors,
)

_BASE = dict(vocab=384, dim=128, layers=2, heads=4, kv_heads=2, ffn=256, ctx=256, eps=1e-5)
_SMALL = dict(vocab=320, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, ctx=256, eps=1e-6)

MODELS = {
  "llama": dict(
    _BASE, arch="llama", rope_base=10000.0, tied=False, bias=False, pre="llama-bpe", add_bos=True
  ),
  "qwen2": dict(
    _BASE, arch="qwen2", rope_base=1e6, eps=1e-6, tied=True, bias=True, pre="qwen2", add_bos=False
  ),
  # Llama 3.1: rope_freqs from the converter's llama3 formula (factor 8, original context 64)
  "llama31": dict(
    _SMALL,
    arch="llama",
    rope_base=500000.0,
    tied=False,
    pre="llama-bpe",
    add_bos=True,
    llama3_rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=64),
  ),
  # head_dim 32 != dim / heads, as Qwen3's key_length; tied like Qwen3-0.6B
  "qwen3": dict(_SMALL, arch="qwen3", head_dim=32, rope_base=1e6, tied=True, pre="qwen2"),
  # MQA, head_dim != dim / heads, as Gemma 7B
  "gemma": dict(_SMALL, arch="gemma", kv_heads=1, head_dim=32, rope_base=10000.0, tied=True),
  "gemma2": dict(
    _SMALL,
    arch="gemma2",
    layers=4,
    head_dim=16,
    rope_base=10000.0,
    tied=True,
    window=8,
    attn_softcap=4.0,
    final_softcap=8.0,
  ),
  "gemma3": dict(
    _SMALL,
    arch="gemma3",
    layers=6,
    head_dim=16,
    ffn=96,
    rope_base=1e6,
    tied=True,
    window=8,
    rope_base_swa=10000.0,
    linear_factor=8.0,
  ),
  "phi3": dict(
    _SMALL,
    arch="phi3",
    ctx=1024,
    rope_base=10000.0,
    tied=False,
    sliding_window_key=8,
    name="tiny-phi",  # llama.cpp's vocab looks up '</s>' in a model named *phi3*
    longrope=dict(original=256),
  ),
}
"""Each test model: its arch and shapes, and what its converter would write."""


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
  """The converter's `rope_freqs` for rope_type llama3 (`LlamaModel.generate_extra_tensors`)."""
  r, hd = cfg["llama3_rope"], head_dim(cfg)
  freqs = 1.0 / (cfg["rope_base"] ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
  low_wavelen = r["original"] / r["low_freq_factor"]
  high_wavelen = r["original"] / r["high_freq_factor"]
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      out.append(1.0)
    elif wavelen > low_wavelen:
      out.append(r["factor"])
    else:
      smooth = (r["original"] / wavelen - r["low_freq_factor"]) / (
        r["high_freq_factor"] - r["low_freq_factor"]
      )
      out.append(1 / ((1 - smooth) / r["factor"] + smooth))
  return np.asarray(out, np.float32)


def head_dim(cfg: dict) -> int:
  return cfg.get("head_dim", cfg["dim"] // cfg["heads"])


def make_weights(cfg: dict, vocab: int, seed: int) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF numpy order ([n_out, n_in]), converter layout.

  The random draws for 'llama' and 'qwen2' are those the committed files were made with."""
  rng = np.random.default_rng(seed)
  arch, d, hd = cfg["arch"], cfg["dim"], head_dim(cfg)
  gemma = arch.startswith("gemma")

  def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

  def norm(n: int) -> np.ndarray:  # gemma's converter stores HF's w + 1: the same thing here
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  embed_gain = 0.3 if cfg["tied"] else 1.0  # tied: the table is the output projection too
  if gemma:  # the graph scales the embeddings by sqrt(dim): entries ~ 1 once scaled
    embed_gain = 1.0 / np.sqrt(d)
  w = {"token_embd.weight": (embed_gain * rng.standard_normal((vocab, d))).astype(np.float32)}
  for i in range(cfg["layers"]):
    p = f"blk.{i}."
    q = mat(cfg["heads"] * hd, d, 2.0)
    k = mat(cfg["kv_heads"] * hd, d, 2.0)
    if arch == "llama":  # the converter's permutation of HF's q/k rows
      q, k = hf_to_gguf_permute(q, cfg["heads"]), hf_to_gguf_permute(k, cfg["kv_heads"])
    w[p + "attn_norm.weight"] = norm(d)
    v = mat(cfg["kv_heads"] * hd, d)
    if arch == "phi3":  # HF's qkv_proj, as the converter writes it
      w[p + "attn_qkv.weight"] = np.concatenate([q, k, v])
    else:
      w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"] = q, k, v
    if cfg.get("bias"):
      w[p + "attn_q.bias"] = (0.1 * rng.standard_normal(cfg["heads"] * hd)).astype(np.float32)
      w[p + "attn_k.bias"] = (0.1 * rng.standard_normal(cfg["kv_heads"] * hd)).astype(np.float32)
      w[p + "attn_v.bias"] = (0.1 * rng.standard_normal(cfg["kv_heads"] * hd)).astype(np.float32)
    if arch in ("qwen3", "gemma3"):
      w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"] = norm(hd), norm(hd)
    w[p + "attn_output.weight"] = mat(d, cfg["heads"] * hd)
    w[p + "ffn_norm.weight"] = norm(d)
    gate, up = mat(cfg["ffn"], d), mat(cfg["ffn"], d)
    if arch == "phi3":  # HF's gate_up_proj: gate rows, then up rows
      w[p + "ffn_up.weight"] = np.concatenate([gate, up])
    else:
      w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"] = gate, up
    w[p + "ffn_down.weight"] = mat(d, cfg["ffn"])
    if arch in ("gemma2", "gemma3"):
      w[p + "post_attention_norm.weight"] = norm(d)
      w[p + "post_ffw_norm.weight"] = norm(d)
  w["output_norm.weight"] = norm(d)
  if not cfg["tied"]:
    w["output.weight"] = mat(vocab, d, 4.0)
  if "llama3_rope" in cfg:
    w["rope_freqs.weight"] = llama3_rope_freqs(cfg)
  if "longrope" in cfg:  # the HF config's long_factor / short_factor lists
    w["rope_factors_long.weight"] = rng.uniform(1.0, 8.0, hd // 2).astype(np.float32)
    w["rope_factors_short.weight"] = rng.uniform(1.0, 1.5, hd // 2).astype(np.float32)
  return w


def write_gguf(
  path: Path,
  cfg: dict,
  weights: dict[str, np.ndarray],
  vocab: tuple[list[str], list[str], dict[str, int]],
  q8: bool,
) -> None:
  tokens, merges, specials = vocab
  arch, d, hd = cfg["arch"], cfg["dim"], head_dim(cfg)
  writer = gguf.GGUFWriter(path, arch)
  writer.add_name(cfg.get("name", f"tiny-{arch}"))
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
  writer.add_context_length(cfg["ctx"])
  writer.add_embedding_length(d)
  writer.add_block_count(cfg["layers"])
  writer.add_feed_forward_length(cfg["ffn"])
  writer.add_head_count(cfg["heads"])
  writer.add_head_count_kv(cfg["kv_heads"])
  if arch in ("llama", "qwen2", "phi3"):
    writer.add_rope_dimension_count(hd)
  if "head_dim" in cfg:
    writer.add_key_length(hd)
    writer.add_value_length(hd)
  writer.add_rope_freq_base(cfg["rope_base"])
  writer.add_layer_norm_rms_eps(cfg["eps"])
  if "window" in cfg:
    writer.add_sliding_window(cfg["window"])
  if "sliding_window_key" in cfg:  # phi3's converter writes it; llama.cpp disables phi3 SWA
    writer.add_sliding_window(cfg["sliding_window_key"])
  if "attn_softcap" in cfg:
    writer.add_attn_logit_softcapping(cfg["attn_softcap"])
    writer.add_final_logit_softcapping(cfg["final_softcap"])
  if "rope_base_swa" in cfg:
    writer.add_rope_freq_base_swa(cfg["rope_base_swa"])
  if "linear_factor" in cfg:
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(cfg["linear_factor"])
  if "longrope" in cfg:  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
    orig = cfg["longrope"]["original"]
    writer.add_rope_scaling_orig_ctx_len(orig)
    scale = cfg["ctx"] / orig
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
  writer.add_vocab_size(len(tokens))
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(cfg.get("pre", "gpt-2"))
  writer.add_token_list(tokens)
  types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(specials["<|bos|>"])
  writer.add_eos_token_id(specials["<|eos|>"])
  writer.add_add_bos_token(cfg.get("add_bos", False))
  write_tensors(writer, weights, lambda _, w: q8 and w.ndim == 2)


def tokenize_with_llama_cpp(path: Path) -> tuple[np.ndarray, np.ndarray]:
  """llama.cpp's ids of TOKENIZER_STRINGS (add_bos as the file says): concatenated ids, offsets."""
  from llama_cpp import Llama

  llm = Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
  ids, offsets = [], [0]
  for s in TOKENIZER_STRINGS:
    t = llm.tokenize(s.encode("utf-8"), add_bos=True, special=False)
    ids += t
    offsets.append(len(ids))
  return np.asarray(ids, np.int32), np.asarray(offsets, np.int32)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="tests/data/gguf_models")
  ap.add_argument("--only", nargs="*", help="models to (re)write (default: those not there)")
  ap.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (gpt-oss's template)")
  args = ap.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  import llama_cpp

  for seed, (name, cfg) in enumerate(MODELS.items()):
    npz = out / f"tiny-{name}.npz"
    if (args.only and name not in args.only) or (not args.only and npz.exists()):
      continue
    vocab = train_vocab(cfg["vocab"])
    weights = make_weights(cfg, len(vocab[0]), seed)
    q8_path, f32_path = out / f"tiny-{name}-q8_0.gguf", out / f"tiny-{name}-f32.gguf"
    write_gguf(q8_path, cfg, weights, vocab, q8=True)
    write_gguf(f32_path, cfg, weights, vocab, q8=False)
    tok_ids, tok_offsets = tokenize_with_llama_cpp(q8_path)
    prompt_ids = llama_cpp.Llama(model_path=str(q8_path), vocab_only=True, verbose=False).tokenize(
      PROMPT.encode(), add_bos=True, special=False
    )
    q8_logits, q8_tokens, n_ctx = run_llama_cpp(q8_path, prompt_ids, N_NEW)
    f32_logits, f32_tokens, _ = run_llama_cpp(f32_path, prompt_ids, N_NEW)
    extra = {}
    if "longrope" in cfg:  # a context over the original one: llama.cpp's long factors
      for kind, path in (("q8", q8_path), ("f32", f32_path)):
        logits, tokens, n_long = run_llama_cpp(path, prompt_ids, N_NEW, n_ctx=512)
        extra.update({f"{kind}_long_logits": logits, f"{kind}_long_tokens": tokens})
      extra["n_ctx_long"] = n_long
    if cfg["arch"].startswith("gemma"):  # the FFN off (ffn_up zero): no GELU in the graph
      no_ffn = out / f"tiny-{name}-no-ffn.gguf"
      zeroed = {n: (0 * a if n.endswith("ffn_up.weight") else a) for n, a in weights.items()}
      write_gguf(no_ffn, cfg, zeroed, vocab, q8=False)
      extra["f32_no_ffn_logits"] = run_llama_cpp(no_ffn, f32_tokens[:-1].tolist(), 1)[0]
      no_ffn.unlink()
    np.savez_compressed(
      npz,
      prompt=PROMPT,
      prompt_ids=np.asarray(prompt_ids, np.int32),
      q8_logits=q8_logits,
      q8_tokens=q8_tokens,
      f32_logits=f32_logits,
      f32_tokens=f32_tokens,
      n_ctx=n_ctx,
      tok_strings=np.asarray(TOKENIZER_STRINGS),
      tok_ids=tok_ids,
      tok_offsets=tok_offsets,
      llama_cpp_version=llama_cpp.__version__,
      **extra,
    )
    print(
      f"{name}: {q8_path.stat().st_size:,} B Q8_0, {f32_path.stat().st_size:,} B F32;"
      f" prompt {len(prompt_ids)} tokens; n_ctx {n_ctx}; greedy Q8_0"
      f" {q8_tokens[len(prompt_ids) :].tolist()}"
    )
  name = gguf_gpt_oss.NAME
  if name in (args.only or ()) or (not args.only and not (out / f"tiny-{name}.npz").exists()):
    gguf_gpt_oss.write_all(out, len(MODELS), args.sdist)
  gguf_moe.write_all(out, len(MODELS) + 3, args.only)
  gguf_gemma4.write_all(out, len(MODELS) + 1, args.only)


if __name__ == "__main__":
  main()
