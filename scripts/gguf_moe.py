"""The small mixture-of-experts test models `qwen3moe` and `mixtral` (arch `llama` with
`ffn_*_exps`) and llama.cpp's outputs on them, for scripts/make_gguf_references.py
(`--only qwen3moe mixtral`).

Each is laid out as llama.cpp's converter writes it (conversion/qwen.py's Qwen3MoeModel,
conversion/llama.py's LlamaModel for Mixtral): per layer a router `ffn_gate_inp` `[E, dim]`
and three expert stacks `ffn_gate_exps` / `ffn_up_exps` `[E, F, dim]` and `ffn_down_exps`
`[E, dim, F]`, 8 experts of which each token uses 2, softmax then top-k then the chosen
weights normalised (both graphs). qwen3moe has Qwen 3's QK-norm, NEOX rope, `key_length` 32
!= dim / heads, `expert_feed_forward_length` beside a dense `feed_forward_length` it does
not use, and an untied output; mixtral has llama's permuted q / k rows (NORM rope) and the
experts as wide as `feed_forward_length`.

Files (in `out`), per model NAME:

  tiny-NAME-f32.gguf     every tensor F32;
  tiny-NAME-q8_0.gguf    weights Q8_0 (gguf.quants) but the router, as the converter keeps it;
  tiny-NAME-q4_k_m.gguf  llama.cpp's own `llama_model_quantize` of the F32 file with ftype
                         MOSTLY_Q4_K_M (at these widths, not multiples of 256, llama.cpp falls
                         back to Q5_0 / Q8_0 for the K-quant types);
  tiny-NAME.npz          llama.cpp's logits and greedy tokens on each file, its logits on the
                         quantized files fed the F32 file's tokens (`*_on_f32_logits`), its
                         token ids of the tokenizer strings and of TEXT (100+ tokens).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tiny_gguf_parts import (
  N_NEW,
  PROMPT,
  TEXT,
  TOKENIZER_STRINGS,
  hf_to_gguf_permute,
  llama_quantize,
  run_llama_cpp,
  train_vocab,
  write_tensors,
)

_COMMON = dict(vocab=320, dim=64, layers=2, heads=4, kv_heads=2, experts=8, experts_used=2)
MOE_MODELS = {
  "qwen3moe": dict(
    _COMMON, arch="qwen3moe", head_dim=32, ffn=96, expert_ffn=32, rope_base=1e6, eps=1e-6,
    pre="qwen2", add_bos=False,
  ),
  "mixtral": dict(
    _COMMON, arch="llama", head_dim=16, ffn=64, rope_base=1e6, eps=1e-5, pre="llama-bpe",
    add_bos=True,
  ),
}  # fmt: skip
"""Each model's sizes (Qwen3-30B-A3B: dim 2048, 48 layers, 32 heads of 128, 4 KV heads, 128
experts of 768, top 8; Mixtral 8x7B: dim 4096, 32 layers, 8 experts of 14336, top 2)."""


def make_weights(cfg: dict, vocab: int, seed: int) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF numpy order ([n_out, n_in]; experts [E, n_out, n_in])."""
  rng = np.random.default_rng(seed)
  d, hd, e = cfg["dim"], cfg["head_dim"], cfg["experts"]
  f = cfg.get("expert_ffn", cfg["ffn"])

  def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

  def norm(n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  w = {"token_embd.weight": rng.standard_normal((vocab, d)).astype(np.float32)}
  for i in range(cfg["layers"]):
    p = f"blk.{i}."
    q, k = mat(cfg["heads"] * hd, d, gain=2.0), mat(cfg["kv_heads"] * hd, d, gain=2.0)
    if cfg["arch"] == "llama":  # the converter's permutation of HF's q/k rows
      q, k = hf_to_gguf_permute(q, cfg["heads"]), hf_to_gguf_permute(k, cfg["kv_heads"])
    w[p + "attn_norm.weight"] = norm(d)
    w[p + "attn_q.weight"], w[p + "attn_k.weight"] = q, k
    w[p + "attn_v.weight"] = mat(cfg["kv_heads"] * hd, d)
    if cfg["arch"] == "qwen3moe":
      w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"] = norm(hd), norm(hd)
    w[p + "attn_output.weight"] = mat(d, cfg["heads"] * hd)
    w[p + "ffn_norm.weight"] = norm(d)
    w[p + "ffn_gate_inp.weight"] = mat(e, d, gain=3.0)  # a router with clear preferences
    w[p + "ffn_gate_exps.weight"] = mat(e, f, d, gain=2.0)
    w[p + "ffn_up_exps.weight"] = mat(e, f, d, gain=2.0)
    w[p + "ffn_down_exps.weight"] = mat(e, d, f)
  w["output_norm.weight"] = norm(d)
  w["output.weight"] = mat(vocab, d, gain=4.0)
  return w


def q8_0_in_file(name: str, w: np.ndarray) -> bool:
  """Whether the Q8_0 file stores `name` as Q8_0: weights of two or more axes but the router
  (the converter's and llama-quantize's rule)."""
  return name.endswith(".weight") and w.ndim >= 2 and not name.endswith("ffn_gate_inp.weight")


def write(path: Path, cfg: dict, weights: dict, vocab: tuple, q8: bool) -> None:
  """The model as gguf-py writes it (the converter's keys)."""
  tokens, merges, specials = vocab
  writer = gguf.GGUFWriter(path, cfg["arch"])
  writer.add_name(f"tiny-{cfg['arch']}-moe")
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
  writer.add_context_length(256)
  writer.add_embedding_length(cfg["dim"])
  writer.add_block_count(cfg["layers"])
  writer.add_feed_forward_length(cfg["ffn"])
  writer.add_head_count(cfg["heads"])
  writer.add_head_count_kv(cfg["kv_heads"])
  if cfg["arch"] == "qwen3moe":
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_expert_feed_forward_length(cfg["expert_ffn"])
  else:
    writer.add_rope_dimension_count(cfg["head_dim"])
  writer.add_rope_freq_base(cfg["rope_base"])
  writer.add_layer_norm_rms_eps(cfg["eps"])
  writer.add_expert_count(cfg["experts"])
  writer.add_expert_used_count(cfg["experts_used"])
  writer.add_vocab_size(len(tokens))
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(cfg["pre"])
  writer.add_token_list(tokens)
  types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(specials["<|bos|>"])
  writer.add_eos_token_id(specials["<|eos|>"])
  writer.add_add_bos_token(cfg["add_bos"])
  write_tensors(writer, weights, lambda name, w: q8 and q8_0_in_file(name, w))


def tokenize_refs(path: Path, add_bos: bool) -> dict[str, np.ndarray]:
  """llama.cpp's ids of the tokenizer strings and of TEXT (BOS as the file says)."""
  from llama_cpp import Llama

  llm = Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
  strings = [*TOKENIZER_STRINGS, TEXT]
  ids, offsets = [], [0]
  for s in strings:
    ids += llm.tokenize(s.encode("utf-8"), add_bos=add_bos, special=False)
    offsets.append(len(ids))
  return dict(
    tok_strings=np.asarray(strings),
    tok_ids=np.asarray(ids, np.int32),
    tok_offsets=np.asarray(offsets, np.int32),
  )


def write_all(out: Path, seed: int, only: list[str] | None) -> None:
  """The files and npz of each model of MOE_MODELS (those named in `only`, else those whose
  npz is missing) in `out`."""
  import llama_cpp

  for i, (name, cfg) in enumerate(MOE_MODELS.items()):
    if (only and name not in only) or (not only and (out / f"tiny-{name}.npz").exists()):
      continue
    vocab = train_vocab(cfg["vocab"])
    weights = make_weights(cfg, len(vocab[0]), seed + i)
    paths = {kind: out / f"tiny-{name}-{kind}.gguf" for kind in ("f32", "q8_0", "q4_k_m")}
    write(paths["f32"], cfg, weights, vocab, q8=False)
    write(paths["q8_0"], cfg, weights, vocab, q8=True)
    llama_quantize(paths["f32"], paths["q4_k_m"], gguf.LlamaFileType.MOSTLY_Q4_K_M)
    prompt_ids = llama_cpp.Llama(
      model_path=str(paths["f32"]), vocab_only=True, verbose=False
    ).tokenize(PROMPT.encode(), add_bos=cfg["add_bos"], special=False)
    refs: dict[str, np.ndarray] = {}
    for kind, path in paths.items():
      key = "q8" if kind == "q8_0" else kind
      logits, greedy, n_ctx = run_llama_cpp(path, prompt_ids, N_NEW)
      refs.update({f"{key}_logits": logits, f"{key}_tokens": greedy})
    forced = refs["f32_tokens"][:-1].tolist()
    for key, kind in (("q8", "q8_0"), ("q4_k_m", "q4_k_m")):  # on the F32 run's tokens
      refs[f"{key}_on_f32_logits"] = run_llama_cpp(paths[kind], forced, 1)[0]
    np.savez_compressed(
      out / f"tiny-{name}.npz",
      prompt=PROMPT,
      prompt_ids=np.asarray(prompt_ids, np.int32),
      n_ctx=n_ctx,
      llama_cpp_version=llama_cpp.__version__,
      **refs,
      **tokenize_refs(paths["f32"], cfg["add_bos"]),
    )
    sizes = ", ".join(f"{k} {p.stat().st_size:,} B" for k, p in paths.items())
    print(
      f"{name}: {sizes}; prompt {len(prompt_ids)} tokens; n_ctx {n_ctx};"
      f" greedy F32 {refs['f32_tokens'][len(prompt_ids) :].tolist()}"
    )


__all__ = ["MOE_MODELS", "make_weights", "write", "write_all"]
