"""Write the small GGUF test models and llama.cpp's own outputs on them.

Run with a Python that has llama-cpp-python, gguf, numpy and tokenizers (not
the test environment; the tests only read what this writes):

    python scripts/make_gguf_references.py [--out tests/data/gguf_models]

For each arch ('llama', 'qwen2') it writes, from deterministic random weights:

  tiny-<arch>-q8_0.gguf  weight matrices Q8_0 (gguf.quants, llama.cpp's
                         quantizer), norms and biases F32;
  tiny-<arch>-f32.gguf   the same weights, all F32;
  tiny-<arch>.npz        llama.cpp's outputs (see `reference` below).

The files are laid out as llama.cpp's HF converter lays them out: weights
`[n_out, n_in]`; for `llama` the rows of attn_q / attn_k are permuted
(`convert_hf_to_gguf.LlamaModel.permute`) from HF's rotate-half order into the
interleaved order of ggml's NORM rope; `qwen2` is not permuted (NEOX rope);
qwen2 has q/k/v biases and tied embeddings (no output.weight). The vocab is a
byte-level BPE trained here with `tokenizers` on a fixed text, stored as
`tokenizer.ggml.*` (model 'gpt2'; pre 'llama-bpe' for llama, 'qwen2' for
qwen2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np

TEXT = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
In 1969, 3 astronauts flew 384400 km to the Moon; the trip took 76 hours.
Grüße aus München: Straße, Käse, naïve café. Ελληνικά και русский текст, 日本語のテキスト, 中文文本.
def f(x):\n    return x * 2  # code, with    runs   of spaces\tand tabs\n\nand newlines.
Emoji 🙂 and symbols €, ©, ±, ∑. Numbers: 12345678, 3.14159, 2**10 = 1024.
"""
TOKENIZER_STRINGS = [
  "Hello world",
  "The quick brown fox jumps over the lazy dog.",
  "  leading spaces and    runs of spaces   ",
  "tabs\tand\nnewlines\n\n  mixed \t\n",
  "digits 1234567890 and 3.14159 and 2**10=1024",
  "Grüße aus München, naïve café",
  "Ελληνικά русский 日本語 中文 🙂 €",
  "it's don't we'll they've I'M",
  "",
]
PROMPT = "The quick brown fox jumps over"
N_NEW = 32

ARCHS = {
  "llama": dict(
    vocab=384,
    dim=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ffn=256,
    rope_base=10000.0,
    eps=1e-5,
    ctx=256,
    tied=False,
    bias=False,
    pre="llama-bpe",
    add_bos=True,
  ),
  "qwen2": dict(
    vocab=384,
    dim=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ffn=256,
    rope_base=1000000.0,
    eps=1e-6,
    ctx=256,
    tied=True,
    bias=True,
    pre="qwen2",
    add_bos=False,
  ),
}


def train_vocab(size: int) -> tuple[list[str], list[str], dict[str, int]]:
  """(tokens, merges, specials): a byte-level BPE of `size` tokens trained on TEXT."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  specials = ["<|bos|>", "<|eos|>"]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
    vocab_size=size,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([TEXT] * 4, trainer)
  model = json.loads(tok.to_str())["model"]
  vocab = model["vocab"]
  tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, merges, {s: vocab[s] for s in specials}


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's converter (`LlamaModel.permute`): HF rotate-half rows -> interleaved rows."""
  return (
    w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def make_weights(arch: str, cfg: dict, vocab: int, seed: int) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF numpy order ([n_out, n_in]), converter layout."""
  rng = np.random.default_rng(seed)
  d, hd = cfg["dim"], cfg["dim"] // cfg["heads"]

  def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

  def norm(n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  embed_gain = 0.3 if cfg["tied"] else 1.0  # tied: the table is the output projection too
  w = {"token_embd.weight": (embed_gain * rng.standard_normal((vocab, d))).astype(np.float32)}
  for i in range(cfg["layers"]):
    p = f"blk.{i}."
    q = mat(cfg["heads"] * hd, d, 2.0)
    k = mat(cfg["kv_heads"] * hd, d, 2.0)
    if arch == "llama":  # the converter's permutation of HF's q/k rows
      q, k = hf_to_gguf_permute(q, cfg["heads"]), hf_to_gguf_permute(k, cfg["kv_heads"])
    w[p + "attn_norm.weight"] = norm(d)
    w[p + "attn_q.weight"] = q
    w[p + "attn_k.weight"] = k
    w[p + "attn_v.weight"] = mat(cfg["kv_heads"] * hd, d)
    if cfg["bias"]:
      w[p + "attn_q.bias"] = (0.1 * rng.standard_normal(cfg["heads"] * hd)).astype(np.float32)
      w[p + "attn_k.bias"] = (0.1 * rng.standard_normal(cfg["kv_heads"] * hd)).astype(np.float32)
      w[p + "attn_v.bias"] = (0.1 * rng.standard_normal(cfg["kv_heads"] * hd)).astype(np.float32)
    w[p + "attn_output.weight"] = mat(d, cfg["heads"] * hd)
    w[p + "ffn_norm.weight"] = norm(d)
    w[p + "ffn_gate.weight"] = mat(cfg["ffn"], d)
    w[p + "ffn_up.weight"] = mat(cfg["ffn"], d)
    w[p + "ffn_down.weight"] = mat(d, cfg["ffn"])
  w["output_norm.weight"] = norm(d)
  if not cfg["tied"]:
    w["output.weight"] = mat(vocab, d, 4.0)
  return w


def write_gguf(
  path: Path,
  arch: str,
  cfg: dict,
  weights: dict[str, np.ndarray],
  vocab: tuple[list[str], list[str], dict[str, int]],
  q8: bool,
) -> None:
  tokens, merges, specials = vocab
  d = cfg["dim"]
  writer = gguf.GGUFWriter(path, arch)
  writer.add_name(f"tiny-{arch}")
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
  writer.add_context_length(cfg["ctx"])
  writer.add_embedding_length(d)
  writer.add_block_count(cfg["layers"])
  writer.add_feed_forward_length(cfg["ffn"])
  writer.add_head_count(cfg["heads"])
  writer.add_head_count_kv(cfg["kv_heads"])
  writer.add_rope_dimension_count(d // cfg["heads"])
  writer.add_rope_freq_base(cfg["rope_base"])
  writer.add_layer_norm_rms_eps(cfg["eps"])
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
  for name, w in weights.items():
    if q8 and w.ndim == 2:
      writer.add_tensor(
        name,
        gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
      )
    else:
      writer.add_tensor(name, w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def run_llama_cpp(path: Path, prompt_ids: list[int], n_new: int) -> tuple[np.ndarray, np.ndarray]:
  """llama.cpp's logits at every position of prompt + greedy continuation, and the tokens.

  The KV cache is F32 (type_k = type_v = 0) so that the F32 file's logits are
  not rounded through an F16 cache. Returns (logits (T, vocab) float32, tokens (T,) int32)
  with T = len(prompt_ids) + n_new - 1 logits rows fed (the last new token is not fed).
  """
  from llama_cpp import Llama

  llm = Llama(
    model_path=str(path),
    n_ctx=128,
    n_batch=128,
    logits_all=True,
    n_threads=2,
    type_k=0,
    type_v=0,
    flash_attn=False,
    verbose=False,
  )
  llm.eval(prompt_ids)
  tokens = list(prompt_ids)
  for step in range(n_new):
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    tokens.append(nxt)
    if step < n_new - 1:
      llm.eval([nxt])
  logits = np.array(llm.scores[: llm.n_tokens], np.float32)
  return logits, np.asarray(tokens, np.int32)


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
  args = ap.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  import llama_cpp

  for seed, (arch, cfg) in enumerate(ARCHS.items()):
    vocab = train_vocab(cfg["vocab"])
    weights = make_weights(arch, cfg, len(vocab[0]), seed)
    q8_path, f32_path = out / f"tiny-{arch}-q8_0.gguf", out / f"tiny-{arch}-f32.gguf"
    write_gguf(q8_path, arch, cfg, weights, vocab, q8=True)
    write_gguf(f32_path, arch, cfg, weights, vocab, q8=False)
    tok_ids, tok_offsets = tokenize_with_llama_cpp(q8_path)
    prompt_ids = llama_cpp.Llama(model_path=str(q8_path), vocab_only=True, verbose=False).tokenize(
      PROMPT.encode(), add_bos=True, special=False
    )
    q8_logits, q8_tokens = run_llama_cpp(q8_path, prompt_ids, N_NEW)
    f32_logits, f32_tokens = run_llama_cpp(f32_path, prompt_ids, N_NEW)
    np.savez_compressed(
      out / f"tiny-{arch}.npz",
      prompt=PROMPT,
      prompt_ids=np.asarray(prompt_ids, np.int32),
      q8_logits=q8_logits,
      q8_tokens=q8_tokens,
      f32_logits=f32_logits,
      f32_tokens=f32_tokens,
      tok_strings=np.asarray(TOKENIZER_STRINGS),
      tok_ids=tok_ids,
      tok_offsets=tok_offsets,
      llama_cpp_version=llama_cpp.__version__,
    )
    print(
      f"{arch}: {q8_path.stat().st_size:,} B Q8_0, {f32_path.stat().st_size:,} B F32;"
      f" prompt {len(prompt_ids)} tokens; greedy Q8_0 {q8_tokens[len(prompt_ids) :].tolist()}"
    )


if __name__ == "__main__":
  main()
