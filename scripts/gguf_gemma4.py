"""The small `gemma4` test models and llama.cpp's outputs on them, for
scripts/make_gguf_references.py (`--only gemma4-e2b gemma4-31b gemma4-moe`).

The layouts are what llama.cpp's converter writes for Gemma 4 (conversion/gemma.py,
`Gemma4Model`) at small sizes, with the keys and tensors llama.cpp's loader reads
(src/models/gemma4.cpp):

  gemma4-e2b   as E2B / E4B: per-layer embeddings (`per_layer_token_embd`,
               `per_layer_model_proj`, `per_layer_proj_norm`, and each layer's `inp_gate`,
               `proj`, `post_norm`), the last 3 of 6 layers sharing the KV of layers 1 (local)
               and 2 (global) (`attention.shared_kv_layers`; their unused attn_k / attn_v /
               attn_k_norm are in the file, as HF's checkpoints have them), FFN twice as wide
               on the shared layers (`feed_forward_length` per layer), one KV head;
  gemma4-31b   as 31B: no per-layer embeddings, KV heads per kind (`attention.head_count_kv`
               2 on local, 1 on global layers), global layers without `attn_v` (K is V);
  gemma4-moe   as 26B-A4B: 31B's attention on 4 layers, and in each 8 experts (top 2, width
               32) beside the dense FFN: the router `ffn_gate_inp` (kept F32, as llama.cpp
               keeps it) with its `ffn_gate_inp.scale`, the experts' gate and up as one
               `ffn_gate_up_exps` stack, `ffn_down_exps` with a per-expert
               `ffn_down_exps.scale`, the branches' norms `post_ffw_norm_1`, `pre_ffw_norm_2`,
               `post_ffw_norm_2`.

Both: local / global layers in Gemma 4's pattern (2 local, 1 global; window 8, shorter than
the test sequences), head width 16 local / 32 global (`key_length_swa` / `key_length`), QK
norms, post-attention / post-FFN norms, `layer_output_scale`, proportional rope on the global
layers (`rope_freqs`: a quarter of the pairs rotate, the rest have factor 1e30), rope bases
1e6 (global) and 1e4 (local), final soft-capping 30. The vocabulary is Gemma 4's own
(llama.cpp's ggml-vocab-gemma-4.gguf: tokenizer model 'gemma4') cut to its first 640 tokens
with the merges among them, and the file's chat template is Gemma 4's, from the same file.

Files (in `out`), per model:

  tiny-<name>-f32.gguf     every tensor F32;
  tiny-<name>-q8_0.gguf    weights Q8_0 (gguf.quants) but `per_layer_model_proj`, as
                           llama.cpp's quantizer keeps it; norms, scales, rope_freqs F32;
  tiny-<name>-q4_k_m.gguf  llama.cpp's own `llama_model_quantize` of the F32 file, Q4_K_M
                           (rows of 64 are no whole K-quant superblock: its fallback types);
  tiny-<name>.npz          llama.cpp's logits and greedy tokens on each file, its logits on the
                           quantized files fed the F32 file's tokens (`*_on_f32_logits`), on the
                           F32 file with every GELU's input zeroed (`f32_no_gelu_logits`), its
                           ids of the tokenizer strings and of `TEXT` (no BOS) and its chat
                           renderings of CONVERSATIONS (`chat_messages`, JSON) and their ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tiny_gguf_parts import (
  N_NEW,
  PROMPT,
  TEXT,
  TOKENIZER_STRINGS,
  llama_quantize,
  run_llama_cpp,
  write_tensors,
)

ARCH = "gemma4"
VOCAB = 640
_COMMON = dict(
  dim=64,
  layers=6,
  heads=4,
  head_dim=32,
  head_dim_swa=16,
  window=8,
  pattern=(True, True, False, True, True, False),
  rope_base=1e6,
  rope_base_swa=1e4,
  partial_rotary=0.25,
  eps=1e-6,
  ctx=256,
  final_softcap=30.0,
)
CONFIGS = {
  "gemma4-e2b": dict(
    _COMMON,
    heads=2,
    kv_heads=(1,) * 6,
    ffn=(64, 64, 64, 128, 128, 128),
    per_layer=32,
    shared_kv=3,
  ),
  "gemma4-31b": dict(
    _COMMON, kv_heads=(2, 2, 1, 2, 2, 1), ffn=(96,) * 6, per_layer=0, shared_kv=0, k_eq_v=True
  ),
  "gemma4-moe": dict(
    _COMMON,
    layers=4,
    pattern=(True, True, False, True),
    kv_heads=(2, 2, 1, 2),
    ffn=(64,) * 4,
    per_layer=0,
    shared_kv=0,
    k_eq_v=True,
    experts=8,
    experts_used=2,
    expert_ffn=32,
  ),
}
"""Each test model's sizes (E2B: dim 1536, 35 layers, 8 heads, one KV head, head width 256 /
512, per-layer 256, 20 shared layers; 31B: dim 5376, 60 layers, 32 heads, KV heads 16 / 4;
26B-A4B: dim 2816, 30 layers, 16 heads, KV heads 8 / 2, 128 experts of 704, top 8, beside a
dense FFN of 2112)."""
QK_NORM = 0.35
"""The q / k norm weights' size. Gemma 4's attention scale is 1 on RMS-normed q and k: with
weights near 1 the random model's scores have a std of sqrt(head width), its attention picks
one key, and a 1e-4 change of a GELU moves the logits 1e-2. llama.cpp's CPU GELU reads a
float16 table (relative steps of 5e-4), so its logits would then be 5e-3 from the exact
model's; at 0.35 they are 1e-3 from it."""
POST_NORM = 4.0
"""The post-attention / post-FFN norm weights' size: the branches outweigh the token's own
embedding in the residual, so the greedy continuation is not that token again and again."""

CONVERSATIONS = {
  "system_user": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes."},
  ],
  "multi_turn": [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Grüße: 日本語で 🙂"},
  ],
}
"""The conversations whose renderings (add_generation_prompt) and ids the npz records."""


def gemma4_vocab() -> dict:
  """Gemma 4's vocabulary (ggml-vocab-gemma-4.gguf from llama.cpp's test suite) cut to its
  first VOCAB tokens, the merges whose parts and result are all kept, and its chat template."""
  from fetch_llama_vocabs import cache_dir

  r = gguf.GGUFReader(cache_dir() / "ggml-vocab-gemma-4.gguf")

  def field(key: str):
    return r.fields[key].contents()

  tokens = field("tokenizer.ggml.tokens")[:VOCAB]
  kept = set(tokens)
  merges = []
  for m in field("tokenizer.ggml.merges"):
    a, b = m.split(" ", 1)
    if a in kept and b in kept and a + b in kept:
      merges.append(m)
  ids = {k: field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
  return dict(
    tokens=tokens,
    scores=field("tokenizer.ggml.scores")[:VOCAB],
    types=field("tokenizer.ggml.token_type")[:VOCAB],
    merges=merges,
    ids=ids,
    template=field("tokenizer.chat_template"),
  )


def rope_freqs(cfg: dict) -> np.ndarray:
  """The converter's `rope_freqs` for the global layers' proportional rope: 1 for the rotated
  pairs, 1e30 for the others (`Gemma4Model.generate_extra_tensors`)."""
  half = cfg["head_dim"] // 2
  rotated = int(cfg["head_dim"] * cfg["partial_rotary"] / 2)
  return np.asarray([1.0] * rotated + [1e30] * (half - rotated), np.float32)


def make_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF numpy order ([n_out, n_in]), the converter's layout."""
  rng = np.random.default_rng(seed)
  d, layers, p = cfg["dim"], cfg["layers"], cfg["per_layer"]

  def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

  def norm(n: int, scale: float = 1.0) -> np.ndarray:  # Gemma 4 multiplies by w as stored
    return (scale * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

  # the graph scales the embeddings by sqrt(dim): entries ~ 1 once scaled
  w = {"token_embd.weight": (rng.standard_normal((VOCAB, d)) / np.sqrt(d)).astype(np.float32)}
  if p:
    w["per_layer_token_embd.weight"] = (
      rng.standard_normal((VOCAB, layers * p)) / np.sqrt(p)
    ).astype(np.float32)
    w["per_layer_model_proj.weight"] = mat(layers * p, d)
    w["per_layer_proj_norm.weight"] = norm(p)
  for i in range(layers):
    pre, local = f"blk.{i}.", cfg["pattern"][i]
    hd = cfg["head_dim_swa"] if local else cfg["head_dim"]
    kv = cfg["kv_heads"][i] * hd
    w[pre + "attn_norm.weight"] = norm(d)
    w[pre + "attn_q.weight"] = mat(cfg["heads"] * hd, d, 2.0)
    w[pre + "attn_k.weight"] = mat(kv, d, 2.0)
    if local or not cfg.get("k_eq_v"):
      w[pre + "attn_v.weight"] = mat(kv, d)
    w[pre + "attn_q_norm.weight"] = norm(hd, QK_NORM)
    w[pre + "attn_k_norm.weight"] = norm(hd, QK_NORM)
    w[pre + "attn_output.weight"] = mat(d, cfg["heads"] * hd)
    w[pre + "post_attention_norm.weight"] = norm(d, POST_NORM)
    w[pre + "ffn_norm.weight"] = norm(d)
    f = cfg["ffn"][i]
    w[pre + "ffn_gate.weight"], w[pre + "ffn_up.weight"] = mat(f, d), mat(f, d)
    w[pre + "ffn_down.weight"] = mat(d, f)
    w[pre + "post_ffw_norm.weight"] = norm(d, POST_NORM)
    if p:
      w[pre + "inp_gate.weight"] = mat(p, d)
      w[pre + "proj.weight"] = mat(d, p)
      w[pre + "post_norm.weight"] = norm(d)
    w[pre + "layer_output_scale.weight"] = rng.uniform(0.5, 1.5, 1).astype(np.float32)
    if cfg.get("experts"):
      w.update({pre + k: a for k, a in experts(cfg, rng, norm).items()})
  w["output_norm.weight"] = norm(d)
  w["rope_freqs.weight"] = rope_freqs(cfg)
  return w


def experts(cfg: dict, rng: np.random.Generator, norm) -> dict[str, np.ndarray]:
  """One layer's experts (names in blk.N): the router reads rms_norm(x) / sqrt(dim) times its
  scale, entries ~ 1 / sqrt(dim), so its rows have a gain of 2 sqrt(dim) (logits of std ~ 2:
  clear choices of experts)."""
  d, e, f = cfg["dim"], cfg["experts"], cfg["expert_ffn"]

  def stack(n_out: int, n_in: int) -> np.ndarray:
    return (rng.standard_normal((e, n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

  return {
    "ffn_gate_inp.weight": (rng.standard_normal((e, d)) * 2.0).astype(np.float32),
    "ffn_gate_inp.scale": norm(d),
    "ffn_gate_up_exps.weight": stack(2 * f, d),  # gate rows, then up rows
    "ffn_down_exps.weight": stack(d, f),
    "ffn_down_exps.scale": rng.uniform(0.5, 1.5, e).astype(np.float32),
    "post_ffw_norm_1.weight": norm(d),
    "pre_ffw_norm_2.weight": norm(d),
    "post_ffw_norm_2.weight": norm(d),
  }


def zero_gelu_inputs(weights: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
  """The weights with every GELU's input zeroed: ffn_gate, inp_gate and the experts' gate rows
  (no GELU term left in the graph)."""
  out = {}
  for n, a in weights.items():
    if n.endswith(("ffn_gate.weight", "inp_gate.weight")):
      a = 0 * a
    elif n.endswith("ffn_gate_up_exps.weight"):
      a = a.copy()
      a[:, : cfg["expert_ffn"]] = 0
    out[n] = a
  return out


def q8_0_in_file(name: str, w: np.ndarray) -> bool:
  """Whether the Q8_0 file stores `name` as Q8_0: the weights of two or more axes but
  `per_layer_model_proj` and the router (llama-quantize's rule)."""
  kept = name.startswith("per_layer_model_proj") or name.endswith("ffn_gate_inp.weight")
  return w.ndim >= 2 and not kept


def write(path: Path, cfg: dict, weights: dict[str, np.ndarray], vocab: dict, q8: bool) -> None:
  """The model as gguf-py writes it, with the keys `Gemma4Model.set_gguf_parameters` writes."""
  writer = gguf.GGUFWriter(path, ARCH)
  writer.add_name(f"tiny-{ARCH}")
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
  writer.add_context_length(cfg["ctx"])
  writer.add_embedding_length(cfg["dim"])
  writer.add_block_count(cfg["layers"])
  ffn = list(cfg["ffn"])
  writer.add_feed_forward_length(ffn if len(set(ffn)) > 1 else ffn[0])
  writer.add_head_count(cfg["heads"])
  kv = list(cfg["kv_heads"])
  writer.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
  writer.add_rope_freq_base(cfg["rope_base"])
  writer.add_rope_freq_base_swa(cfg["rope_base_swa"])
  writer.add_layer_norm_rms_eps(cfg["eps"])
  writer.add_key_length(cfg["head_dim"])
  writer.add_value_length(cfg["head_dim"])
  writer.add_key_length_swa(cfg["head_dim_swa"])
  writer.add_value_length_swa(cfg["head_dim_swa"])
  writer.add_rope_dimension_count(cfg["head_dim"])
  writer.add_rope_dimension_count_swa(cfg["head_dim_swa"])
  writer.add_final_logit_softcapping(cfg["final_softcap"])
  writer.add_sliding_window(cfg["window"])
  writer.add_sliding_window_pattern(list(cfg["pattern"]))
  writer.add_shared_kv_layers(cfg["shared_kv"])
  writer.add_embedding_length_per_layer_input(cfg["per_layer"])
  if cfg.get("experts"):
    writer.add_expert_count(cfg["experts"])
    writer.add_expert_used_count(cfg["experts_used"])
    writer.add_expert_feed_forward_length(cfg["expert_ffn"])
  writer.add_tokenizer_model("gemma4")
  writer.add_token_list(vocab["tokens"])
  writer.add_token_scores(vocab["scores"])
  writer.add_token_types(vocab["types"])
  writer.add_token_merges(vocab["merges"])
  writer.add_bos_token_id(vocab["ids"]["bos"])
  writer.add_eos_token_id(vocab["ids"]["eos"])
  writer.add_unk_token_id(vocab["ids"]["unknown"])
  writer.add_pad_token_id(vocab["ids"]["padding"])
  writer.add_add_space_prefix(False)
  writer.add_add_bos_token(True)
  writer.add_chat_template(vocab["template"])
  write_tensors(writer, weights, lambda name, w: q8 and q8_0_in_file(name, w))


def tokenize_refs(path: Path) -> dict[str, np.ndarray]:
  """llama.cpp's ids of the tokenizer strings and TEXT (no BOS, specials as text), and
  llama-cpp-python's renderings of CONVERSATIONS with their ids (specials parsed)."""
  from llama_cpp import Llama
  from llama_cpp.llama_chat_format import Jinja2ChatFormatter

  llm = Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
  strings = [*TOKENIZER_STRINGS, TEXT]
  ids, offsets = [], [0]
  for s in strings:
    ids += llm.tokenize(s.encode("utf-8"), add_bos=False, special=False)
    offsets.append(len(ids))
  bos = llm._model.token_get_text(llm.token_bos())
  eos = llm._model.token_get_text(llm.token_eos())
  template = llm.metadata["tokenizer.chat_template"]
  texts, chat_ids, chat_offsets = [], [], [0]
  for messages in CONVERSATIONS.values():
    fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    text = fmt(messages=messages).prompt
    texts.append(text)
    chat_ids += llm.tokenize(text.encode(), add_bos=False, special=True)
    chat_offsets.append(len(chat_ids))
  return dict(
    tok_strings=np.asarray(strings),
    tok_ids=np.asarray(ids, np.int32),
    tok_offsets=np.asarray(offsets, np.int32),
    chat_names=np.asarray(list(CONVERSATIONS)),
    chat_messages=np.asarray(json.dumps(list(CONVERSATIONS.values()))),
    chat_texts=np.asarray(texts),
    chat_ids=np.asarray(chat_ids, np.int32),
    chat_offsets=np.asarray(chat_offsets, np.int32),
  )


def write_model(out: Path, name: str, seed: int) -> None:
  """The three files and tiny-<name>.npz of model `name` in `out`."""
  import llama_cpp

  cfg, vocab = CONFIGS[name], gemma4_vocab()
  weights = make_weights(cfg, seed)
  paths = {kind: out / f"tiny-{name}-{kind}.gguf" for kind in ("f32", "q8_0", "q4_k_m")}
  write(paths["f32"], cfg, weights, vocab, q8=False)
  write(paths["q8_0"], cfg, weights, vocab, q8=True)
  llama_quantize(paths["f32"], paths["q4_k_m"], gguf.LlamaFileType.MOSTLY_Q4_K_M)
  prompt_ids = llama_cpp.Llama(
    model_path=str(paths["f32"]), vocab_only=True, verbose=False
  ).tokenize(PROMPT.encode(), add_bos=True, special=False)
  refs: dict[str, np.ndarray] = {}
  for kind, path in paths.items():
    key = "q8" if kind == "q8_0" else kind
    logits, greedy, n_ctx = run_llama_cpp(path, prompt_ids, N_NEW)
    refs.update({f"{key}_logits": logits, f"{key}_tokens": greedy})
  forced = refs["f32_tokens"][:-1].tolist()
  for key in ("q8", "q4_k_m"):  # the quantized files on the F32 run's tokens: comparable rows
    refs[f"{key}_on_f32_logits"] = run_llama_cpp(paths[key.replace("q8", "q8_0")], forced, 1)[0]
  # every GELU's input zeroed: no GELU term left in the graph
  no_gelu = out / f"tiny-{name}-no-gelu.gguf"
  write(no_gelu, cfg, zero_gelu_inputs(weights, cfg), vocab, q8=False)
  refs["f32_no_gelu_logits"] = run_llama_cpp(no_gelu, forced, 1)[0]
  no_gelu.unlink()
  np.savez_compressed(
    out / f"tiny-{name}.npz",
    prompt=PROMPT,
    prompt_ids=np.asarray(prompt_ids, np.int32),
    n_ctx=n_ctx,
    llama_cpp_version=llama_cpp.__version__,
    **refs,
    **tokenize_refs(paths["f32"]),
  )
  sizes = ", ".join(f"{k} {p.stat().st_size:,} B" for k, p in paths.items())
  print(
    f"{name}: {sizes}; prompt {len(prompt_ids)} tokens; n_ctx {n_ctx};"
    f" greedy F32 {refs['f32_tokens'][len(prompt_ids) :].tolist()}"
  )


def write_all(out: Path, seed: int, only: list[str] | None) -> None:
  """Every model of CONFIGS named in `only` (None: those whose npz is not in `out`)."""
  for i, name in enumerate(CONFIGS):
    if name in (only or ()) or (not only and not (out / f"tiny-{name}.npz").exists()):
      write_model(out, name, seed + i)


__all__ = ["CONFIGS", "CONVERSATIONS", "make_weights", "write", "write_all"]
