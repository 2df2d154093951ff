"""Is llama.cpp's argmax on a real K-quant file reachable from float math? A float64 forward of
the file's dequantized weights with llama.cpp's own roundings put back, one at a time, against
llama.cpp's logits on the same file and text.

    python benchmarks/llamacpp_rounding.py --llama-cpp-python PY [--models gemma3-q4_k_m] [--write]

The target is argmax agreement >= 0.97 with llama.cpp on the original file. The float64
forward (tests/gguf_numpy_forward.py) is the model without any rounding; each variant adds one
of the roundings llama.cpp's CPU backend makes (llama-cpp-python 0.3.36, flash attention off,
as its log says):

  act      each product's activations quantized as llama.cpp's dot of that tensor's type
           quantizes them: Q8_K (256 values, float scale, round to nearest even) for K-quants,
           Q8_0 (32 values, float16 scale, round half away) for Q8_0 / Q4_0 / Q5_0, Q8_1 for
           Q4_1 / Q5_1 (the same values as Q8_0);
  kv16     the keys, values and queries rounded to float16 (the F16 KV cache; ggml converts q
           to the cache's type for the dot), and the softmax weights too (before the V product);
  gelu16   ggml's GELU read from its float16 table (`gelu_fp16_table`);
  all      the three together.

Each row: argmax agreement and relative L2 error against llama.cpp's logits, argmax agreement
with the unrounded float64 forward, and perplexity over the text. If none comes near 0.97, the
gap is llama.cpp's own rounding noise, not a difference of the model that could be fixed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.llamacpp_native import describe, query  # noqa: E402
from benchmarks.results_md import machine, section, write_section  # noqa: E402
from scripts.fetch_real_models import MODELS, cache_dir, fetch  # noqa: E402
from scripts.real_runs import TEXT, llama, nll  # noqa: E402
from tests import gguf_numpy_forward as F  # noqa: E402

VARIANTS = {
  "float64": set(),
  "act": {"act"},
  "kv16": {"kv16"},
  "gelu16": {"gelu16"},
  "all": {"act", "kv16", "gelu16"},
}


def f16(x: np.ndarray) -> np.ndarray:
  return x.astype(np.float16).astype(np.float64)


def q8_0(x: np.ndarray) -> np.ndarray:
  """ggml's quantize_row_q8_0 and back: per 32 values d = amax / 127 (stored float16),
  q = roundf(x / d)."""
  b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
  d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
  inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
  q = np.trunc(b * inv + np.copysign(np.float32(0.5), b * inv))
  return (q * f16(d).astype(np.float32)).reshape(x.shape).astype(np.float64)


def q8_k(x: np.ndarray) -> np.ndarray:
  """ggml's quantize_row_q8_K and back: per 256 values iscale = -127 / (the value of largest
  magnitude), q = nearest_int(iscale * x) capped at 127, d = 1 / iscale (float32)."""
  b = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
  big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
  iscale = np.float32(-127) / np.where(big == 0, 1, big)
  q = np.minimum(np.rint(iscale * b), 127)
  return np.where(big == 0, 0, q * (np.float32(1) / iscale)).reshape(x.shape).astype(np.float64)


ACTIVATIONS = {"Q8_0": q8_0, "Q4_0": q8_0, "Q5_0": q8_0, "Q4_1": q8_0, "Q5_1": q8_0}
ACTIVATIONS |= {t: q8_k for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}


def rounded_forward(hp: dict, w: dict, types: dict[str, str], ids: list[int], mode: set[str]):
  """tests/gguf_numpy_forward.py's float64 forward with the roundings of `mode` put back."""

  def mm(x: np.ndarray, weight: np.ndarray, name: str) -> np.ndarray:
    quant = ACTIVATIONS.get(types[name]) if "act" in mode else None
    if quant is not None and x.shape[-1] % (256 if quant is q8_k else 32) == 0:
      x = quant(x)
    return x @ weight.T

  return F.forward(
    hp,
    w,
    ids,
    n_ctx=len(ids),
    gelu=F.gelu_fp16_table if "gelu16" in mode else F.gelu_tanh,
    mm=mm,
    rounded=f16 if "kv16" in mode else (lambda a: a),
  )


def evaluate(key: str, py: str, work: Path) -> list[dict]:
  import gguf

  from q8rules.checkpoint.gguf import open_gguf
  from q8rules.llm.tokenizer import GGUFTokenizer

  path = fetch(MODELS[key], cache_dir())
  with open_gguf(path) as ckpt:
    meta = ckpt.metadata
  ids = GGUFTokenizer.from_metadata(meta, path=str(path)).encode(TEXT)
  out = work / f"{key}-llama.npy"
  llama(py, path, ids, out)
  theirs = np.load(out).astype(np.float64)
  types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
  hp, w = F.load_float64(path)
  logits = {n: rounded_forward(hp, w, types, ids, mode) for n, mode in VARIANTS.items()}
  rows = []
  for n, lo in logits.items():
    rows.append(
      dict(
        file=MODELS[key].file,
        variant=n,
        tokens=len(ids),
        argmax=float(np.mean(lo.argmax(-1) == theirs.argmax(-1))),
        err=float(np.linalg.norm(lo - theirs) / np.linalg.norm(theirs)),
        argmax_f64=float(np.mean(lo.argmax(-1) == logits["float64"].argmax(-1))),
        ppl=float(np.exp(nll(lo, ids))),
        ppl_llama=float(np.exp(nll(theirs, ids))),
      )
    )
    print(json.dumps(rows[-1]), flush=True)
  return rows


def table(rows: list[dict]) -> str:
  out = [
    "| file | float64 forward with | argmax agreement vs llama.cpp | relative L2 vs llama.cpp"
    " | argmax = unrounded float64's | ppl (llama.cpp's) |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    out.append(
      f"| {r['file']} | {r['variant']} | {r['argmax']:.4f} | {r['err']:.4f} |"
      f" {r['argmax_f64']:.3f} | {r['ppl']:.3f} ({r['ppl_llama']:.3f}) |"
    )
  return "\n".join(out)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--llama-cpp-python", required=True)
  ap.add_argument("--models", default="gemma3-q4_k_m")
  ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "q8rules-rounding"))
  ap.add_argument("--write", action="store_true", help="write the table into RESULTS.md")
  args = ap.parse_args()
  build, _ = describe(**query(args.llama_cpp_python))
  work = Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  rows = [r for key in args.models.split(",") for r in evaluate(key, args.llama_cpp_python, work)]
  text = table(rows)
  print(text)
  if args.write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = f"{when}. Machine: {machine()}. {build}"
    cmd = "python benchmarks/llamacpp_rounding.py --llama-cpp-python PY --write"
    heading = "## llama.cpp's roundings put back into a float64 forward (issue 31's argmax target)"
    write_section("llamacpp-rounding", section("llamacpp-rounding", heading, header, cmd, [text]))


if __name__ == "__main__":
  main()
