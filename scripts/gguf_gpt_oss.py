"""The small `gpt-oss` test model (llama.cpp's openai-moe) and llama.cpp's outputs on it, for
scripts/make_gguf_references.py (`--only gpt-oss`).

The layout is what llama.cpp's converter writes for OpenAI's gpt-oss (conversion/gpt_oss.py)
at small sizes: q, k, v and the output projection with biases, a sink logit per head
(`attn_sinks.weight`), the FFN's norm as `post_attention_norm`, a router with a bias and 8
experts (top 4; gate, up and down stacks `[E, n_out, n_in]` with per-expert biases
`[E, n_out]`), an untied output; NEOX rope with YaRN (factor 32 over an original context of
4096, base 150000), sliding-window attention (window 8) on every other layer. The vocab is
the main script's byte-level BPE plus harmony's special tokens, `tokenizer.ggml.pre`
'gpt-4o' (o200k's regex), and the chat template is gpt-oss's harmony template as llama.cpp's
source distribution ships it (models/templates/openai-gpt-oss-120b.jinja).

Files (in `out`):

  tiny-gpt-oss-f32.gguf    every tensor F32;
  tiny-gpt-oss-q8_0.gguf   weights Q8_0 (gguf.quants) but the router, as the converter keeps
                           it; norms, biases and sinks F32;
  tiny-gpt-oss-mxfp4.gguf  llama.cpp's own `llama_model_quantize` of the F32 file with ftype
                           MOSTLY_MXFP4_MOE: the expert stacks MXFP4, the rest Q8_0;
  tiny-gpt-oss.npz         llama.cpp's logits and greedy tokens on each file, its logits on the
                           quantized files fed the F32 file's tokens (`*_on_f32_logits`), its
                           token ids of the tokenizer strings and of `TEXT` (no BOS), its
                           chat renderings and their ids.
"""

from __future__ import annotations

import json
import math
import tarfile
import tempfile
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
  train_vocab,
  write_tensors,
)

NAME = "gpt-oss"
CONFIG = dict(
  vocab=384,
  dim=64,
  layers=4,
  heads=4,
  kv_heads=2,
  head_dim=16,
  experts=8,
  experts_used=4,
  expert_ffn=32,
  ctx=131072,
  orig_ctx=4096,
  yarn_factor=32.0,
  rope_base=150000.0,
  window=8,
  eps=1e-5,
)
"""The test model's sizes (gpt-oss-20b: dim 2880, 24 layers, 64 heads of 64, 8 KV heads,
32 experts of 2880, top 4, window 128; the rope and its scaling as here)."""

HARMONY_SPECIALS = (
  "<|startoftext|>",
  "<|endoftext|>",
  "<|return|>",
  "<|constrain|>",
  "<|channel|>",
  "<|start|>",
  "<|end|>",
  "<|message|>",
  "<|call|>",
)
"""o200k_harmony's special tokens, after the trained vocab as in the real one (ids 199998+)."""

TEMPLATE_MEMBER = "models/templates/openai-gpt-oss-120b.jinja"
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
"""The conversations whose harmony renderings and ids the npz records."""


def chat_template(sdist: Path | None) -> str:
  """gpt-oss's template from llama-cpp-python's sdist (`pip download`ed when None)."""
  if sdist is None:
    from fetch_llama_vocabs import VERSION, download_sdist

    sdist = download_sdist(VERSION, Path(tempfile.mkdtemp()))
  with tarfile.open(sdist) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith(TEMPLATE_MEMBER))
    f = tar.extractfile(member)
    assert f is not None
    return f.read().decode()


def make_weights(vocab: int, seed: int) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF numpy order ([n_out, n_in]; experts [E, n_out, n_in])."""
  c = CONFIG
  rng = np.random.default_rng(seed)
  d, hd, e, f = c["dim"], c["head_dim"], c["experts"], c["expert_ffn"]

  def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

  def vec(*shape: int, scale: float = 0.1) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  def norm(n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  w = {"token_embd.weight": rng.standard_normal((vocab, d)).astype(np.float32)}
  for i in range(c["layers"]):
    p = f"blk.{i}."
    w[p + "attn_norm.weight"] = norm(d)
    for name, rows in (
      ("q", c["heads"] * hd),
      ("k", c["kv_heads"] * hd),
      ("v", c["kv_heads"] * hd),
    ):
      w[p + f"attn_{name}.weight"] = mat(rows, d)
      w[p + f"attn_{name}.bias"] = vec(rows)
    w[p + "attn_output.weight"] = mat(d, c["heads"] * hd)
    w[p + "attn_output.bias"] = vec(d)
    w[p + "attn_sinks.weight"] = vec(c["heads"], scale=1.0)
    w[p + "post_attention_norm.weight"] = norm(d)
    w[p + "ffn_gate_inp.weight"] = mat(e, d, gain=2.0)
    w[p + "ffn_gate_inp.bias"] = vec(e)
    # gains that put the gate and up values past the activation's clamp (7) now and then
    w[p + "ffn_gate_exps.weight"] = mat(e, f, d, gain=3.0)
    w[p + "ffn_gate_exps.bias"] = vec(e, f)
    w[p + "ffn_up_exps.weight"] = mat(e, f, d, gain=3.0)
    w[p + "ffn_up_exps.bias"] = vec(e, f)
    w[p + "ffn_down_exps.weight"] = mat(e, d, f, gain=0.5)
    w[p + "ffn_down_exps.bias"] = vec(e, d)
  w["output_norm.weight"] = norm(d)
  w["output.weight"] = mat(vocab, d, gain=4.0)
  return w


def q8_0_in_file(name: str, w: np.ndarray) -> bool:
  """Whether the Q8_0 file stores `name` as Q8_0: the weights of two or more axes but the
  router (the converter's and llama-quantize's rule)."""
  return name.endswith(".weight") and w.ndim >= 2 and not name.endswith("ffn_gate_inp.weight")


def write(
  path: Path, weights: dict[str, np.ndarray], vocab: tuple, template: str, q8: bool
) -> None:
  """The model as gguf-py writes it (the converter's keys for gpt-oss)."""
  c = CONFIG
  tokens, merges, specials = vocab
  writer = gguf.GGUFWriter(path, NAME)
  writer.add_name("tiny-gpt-oss")
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
  writer.add_context_length(c["ctx"])
  writer.add_embedding_length(c["dim"])
  writer.add_block_count(c["layers"])
  writer.add_feed_forward_length(c["expert_ffn"])
  writer.add_head_count(c["heads"])
  writer.add_head_count_kv(c["kv_heads"])
  writer.add_key_length(c["head_dim"])
  writer.add_value_length(c["head_dim"])
  writer.add_rope_dimension_count(c["head_dim"])
  writer.add_rope_freq_base(c["rope_base"])
  writer.add_layer_norm_rms_eps(c["eps"])
  writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
  writer.add_rope_scaling_factor(c["yarn_factor"])
  writer.add_rope_scaling_orig_ctx_len(c["orig_ctx"])
  writer.add_expert_count(c["experts"])
  writer.add_expert_used_count(c["experts_used"])
  writer.add_sliding_window(c["window"])
  writer.add_expert_feed_forward_length(c["expert_ffn"])
  writer.add_vocab_size(len(tokens))
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("gpt-4o")
  writer.add_token_list(tokens)
  control = set(specials) | set(HARMONY_SPECIALS)
  writer.add_token_types(
    [gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens]
  )
  writer.add_token_merges(merges)
  writer.add_bos_token_id(tokens.index("<|startoftext|>"))
  writer.add_eos_token_id(tokens.index("<|return|>"))
  writer.add_pad_token_id(tokens.index("<|endoftext|>"))
  writer.add_add_bos_token(False)
  writer.add_chat_template(template)
  write_tensors(writer, weights, lambda name, w: q8 and q8_0_in_file(name, w))


def tokenize_refs(path: Path) -> dict[str, np.ndarray]:
  """llama.cpp's ids of the tokenizer strings and of TEXT (no BOS, specials as text), and of
  the harmony renderings of CONVERSATIONS (specials parsed), with llama-cpp-python's texts."""
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
    chat_messages=json.dumps(list(CONVERSATIONS.values()), ensure_ascii=False),
    chat_texts=np.asarray(texts),
    chat_ids=np.asarray(chat_ids, np.int32),
    chat_offsets=np.asarray(chat_offsets, np.int32),
  )


def write_all(out: Path, seed: int, sdist: Path | None) -> None:
  """The three files and tiny-gpt-oss.npz in `out`."""
  import llama_cpp

  tokens, merges, specials = train_vocab(CONFIG["vocab"])
  vocab = ([*tokens, *HARMONY_SPECIALS], merges, specials)
  weights = make_weights(len(vocab[0]), seed)
  template = chat_template(sdist)
  paths = {kind: out / f"tiny-{NAME}-{kind}.gguf" for kind in ("f32", "q8_0", "mxfp4")}
  write(paths["f32"], weights, vocab, template, q8=False)
  write(paths["q8_0"], weights, vocab, template, q8=True)
  llama_quantize(paths["f32"], paths["mxfp4"], gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
  prompt_ids = llama_cpp.Llama(
    model_path=str(paths["f32"]), vocab_only=True, verbose=False
  ).tokenize(PROMPT.encode(), add_bos=False, special=False)
  refs: dict[str, np.ndarray] = {}
  for kind, path in paths.items():
    key = "q8" if kind == "q8_0" else kind
    logits, greedy, n_ctx = run_llama_cpp(path, prompt_ids, N_NEW)
    refs.update({f"{key}_logits": logits, f"{key}_tokens": greedy})
  for key in ("q8", "mxfp4"):  # the quantized files on the F32 run's tokens: comparable rows
    forced = refs["f32_tokens"][:-1].tolist()
    refs[f"{key}_on_f32_logits"] = run_llama_cpp(paths[key.replace("q8", "q8_0")], forced, 1)[0]
  np.savez_compressed(
    out / f"tiny-{NAME}.npz",
    prompt=PROMPT,
    prompt_ids=np.asarray(prompt_ids, np.int32),
    n_ctx=n_ctx,
    llama_cpp_version=llama_cpp.__version__,
    **refs,
    **tokenize_refs(paths["f32"]),
  )
  sizes = ", ".join(f"{k} {p.stat().st_size:,} B" for k, p in paths.items())
  mscale = 1 + 0.1 * math.log(CONFIG["yarn_factor"])
  print(
    f"{NAME}: {sizes}; prompt {len(prompt_ids)} tokens; n_ctx {n_ctx}; yarn mscale"
    f" {mscale:.4f}; greedy F32 {refs['f32_tokens'][len(prompt_ids) :].tolist()}"
  )


__all__ = ["CONFIG", "HARMONY_SPECIALS", "NAME", "make_weights", "write", "write_all"]
