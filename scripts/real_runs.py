"""What the reference writers (make_real_references.py, make_lora_references.py) and the
benchmarks on the real GGUF files (benchmarks/real_gguf.py, finetune_gguf.py,
llamacpp_rounding.py) share: the texts they read, llama.cpp run on a file in its own process
(logits, greedy tokens with or without a LoRA adapter, llama-quantize), the float64 forward, the
F16 copy of a file and the perplexity they report.

llama.cpp runs with the Python given as `py` (a llama-cpp-python built natively, in its own
venv). The scripts and the benchmarks import this module; it imports no benchmark.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np

from scripts.run_json import run

TEXT = (
  "It was the best of times, it was the worst of times, it was the age of wisdom, it was the"
  " age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the"
  " season of Light, it was the season of Darkness, it was the spring of hope, it was the"
  " winter of despair, we had everything before us, we had nothing before us, we were all"
  " going direct to Heaven, we were all going direct the other way - in short, the period was"
  " so far like the present period, that some of its noisiest authorities insisted on its"
  " being received, for good or for evil, in the superlative degree of comparison only."
)
"""The opening of Dickens's A Tale of Two Cities (1859, public domain)."""

PROMPT = "The for statement is used to iterate over"
"""The prompt whose greedy tokens the LoRA references and benchmark compare."""

GREEDY = 32
"""How many greedy tokens after `PROMPT`."""

LLAMA_LOGITS = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
ids, out = json.loads(sys.argv[2]), sys.argv[3]
t = time.perf_counter()
llm = Llama(sys.argv[1], n_ctx=512, logits_all=True, verbose=False, n_threads=2)
load_s = time.perf_counter() - t
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], np.float32))
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps(dict(load_s=load_s, rss_mb=rss)))
"""
"""llama.cpp's logits at every position of ids (argv: file, ids as JSON, the .npy to write),
its load time and peak RSS."""

LLAMA_GREEDY = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, args = sys.argv[1], json.loads(sys.argv[2])
kw = dict(lora_path=args["lora"]) if args.get("lora") else {}
llm = Llama(path, n_ctx=512, logits_all=True, verbose=False, n_threads=2, **kw)
llm.eval(args["eval_ids"])
np.save(args["out"], np.array(llm.scores[: len(args["eval_ids"])], np.float32))
llm.reset()
ids = list(args["prompt_ids"])
llm.eval(ids)
new, margins = [], []
for _ in range(args["greedy"]):
  row = np.asarray(llm.scores[llm.n_tokens - 1])
  first, second = np.sort(row)[-2:][::-1]
  tok = int(np.argmax(row))
  new.append(tok)
  margins.append(float(first - second))
  llm.eval([tok])
print(json.dumps(dict(greedy=new, margins=margins)))
"""
"""llama.cpp with an optional LoRA adapter (argv: file, a JSON query: `eval_ids`, `out`,
`prompt_ids`, `greedy`, `lora`): logits on eval_ids, then `greedy` tokens after prompt_ids and
the gap between the two largest logits at each."""

QUANTIZE = r"""
import ctypes, json, sys
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
p.allow_requantize = True
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
print(json.dumps(dict(rc=rc)))
"""


def llama(py: str, path: Path, ids: list[int], out: Path) -> dict:
  """llama.cpp's logits on `ids` saved to `out` (`LLAMA_LOGITS`): {'load_s', 'rss_mb'}."""
  return run([py, "-c", textwrap.dedent(LLAMA_LOGITS), str(path), json.dumps(ids), str(out)])


def llama_greedy(py: str, path: Path, query: dict) -> dict:
  """`LLAMA_GREEDY` on `path` with `query`: {'greedy': token ids, 'margins': floats}."""
  return run([py, "-c", textwrap.dedent(LLAMA_GREEDY), str(path), json.dumps(query)])


def llama_quantize(py: str, src: Path, dst: Path) -> None:
  """llama.cpp's Q8_0 file of `src` at `dst` (`QUANTIZE`: llama-quantize --allow-requantize
  ... Q8_0), unless `dst` exists; SystemExit when llama.cpp fails."""
  if not dst.exists():
    res = run([py, "-c", textwrap.dedent(QUANTIZE), str(src), str(dst)])
    if res["rc"] != 0:
      raise SystemExit(f"llama_model_quantize {src} -> {dst} failed: rc {res['rc']}")


def write_f16(src: Path, dst: Path) -> None:
  """`src` with every quantized tensor dequantized (gguf.quants) and written as F16."""
  import gguf

  from q8rules.checkpoint.gguf.requant import is_quantized
  from tests._utils import copy_gguf

  if dst.exists():
    return

  def as_f16(t):
    if is_quantized(t.tensor_type):
      return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
    return np.asarray(t.data), t.tensor_type

  copy_gguf(src, dst, as_f16)


def nll(logits: np.ndarray, ids: list[int]) -> float:
  """Mean next-token negative log-likelihood of ids[1:] under logits[:-1] (float64)."""
  x = logits[:-1].astype(np.float64)
  x -= x.max(-1, keepdims=True)
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  return float(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))


def float64_logits(path: Path, ids: list[int]) -> np.ndarray:
  """(len(ids), vocab) float64: the numpy forward (tests/gguf_numpy_forward.py) of the file's
  dequantized weights on `ids`."""
  from tests import gguf_numpy_forward as ref

  hp, w = ref.load_float64(path)
  return ref.forward(hp, w, ids, n_ctx=len(ids))


__all__ = [
  "GREEDY",
  "LLAMA_GREEDY",
  "LLAMA_LOGITS",
  "PROMPT",
  "QUANTIZE",
  "TEXT",
  "float64_logits",
  "llama",
  "llama_greedy",
  "llama_quantize",
  "nll",
  "write_f16",
]
