"""What every writer of the tiny test GGUF files shares: the text their vocabularies are trained
on, the prompt and strings llama.cpp's outputs are recorded on, the vocabulary trainer, the
converter's q/k permutation, the tensor writer, llama.cpp's quantizer and its greedy run.

scripts/make_gguf_references.py (the dense archs) and scripts/gguf_gpt_oss.py,
scripts/gguf_moe.py and scripts/gguf_gemma4.py (which it runs) import this; it imports none of
them. Run with a Python that has llama-cpp-python, gguf, numpy and tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


def write_tensors(
  writer: gguf.GGUFWriter,
  weights: dict[str, np.ndarray],
  as_q8_0: Callable[[str, np.ndarray], bool],
) -> None:
  """Add `weights` to `writer` (Q8_0 by `gguf.quants`, llama.cpp's quantizer, where
  `as_q8_0(name, w)`, else as they are), write the file and close it."""
  for name, w in weights.items():
    if as_q8_0(name, w):
      quant = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
      writer.add_tensor(name, quant, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      writer.add_tensor(name, w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def llama_quantize(src: Path, dst: Path, ftype: gguf.LlamaFileType) -> None:
  """llama.cpp's own `llama_model_quantize` of `src` to `dst` with file type `ftype`."""
  import llama_cpp

  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = int(ftype)
  params.nthread = 2
  rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
  if rc != 0:
    raise SystemExit(f"llama_model_quantize({src} -> {dst}) failed: {rc}")


def run_llama_cpp(
  path: Path, prompt_ids: list[int], n_new: int, n_ctx: int = 128
) -> tuple[np.ndarray, np.ndarray, int]:
  """llama.cpp's logits at every position of prompt + greedy continuation, and the tokens.

  The KV cache is F32 (type_k = type_v = 0) so that the F32 file's logits are
  not rounded through an F16 cache; flash attention off (it casts K and V to F16).
  Returns (logits (T, vocab) float32, tokens (T,) int32, the context llama.cpp ran
  with (n_ctx rounded up to a multiple of 256)) with T = len(prompt_ids) + n_new - 1
  logits rows fed (the last new token is not fed).
  """
  from llama_cpp import Llama

  llm = Llama(
    model_path=str(path),
    n_ctx=n_ctx,
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
  return logits, np.asarray(tokens, np.int32), int(llm.n_ctx())


__all__ = [
  "N_NEW",
  "PROMPT",
  "TEXT",
  "TOKENIZER_STRINGS",
  "hf_to_gguf_permute",
  "llama_quantize",
  "run_llama_cpp",
  "train_vocab",
  "write_tensors",
]
