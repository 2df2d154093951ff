"""Real, pretrained GGUF files as users download them (Q4_K_M, Q4_1: `scripts/fetch_real_models.py`)
served as Q8_0 by `load_gguf`, against a natively built llama.cpp on the same files.

    python benchmarks/real_gguf.py --llama-cpp-python /work/venv-llamacpp/bin/python [--write]

Per file, each side in a fresh process, page cache warm; peak RSS is the process's own high-water
mark (`VmHWM`: `ru_maxrss` would carry the parent's across exec):

  ours        `load_gguf(file)`: every quantized matrix requantized to Q8_0 at load; load time,
              logits at every position of a real text (`TEXT`, 100+ tokens), peak RSS
  llama.cpp   `Llama(file, logits_all=True)` on the same file and ids: load time, logits, RSS
  llama Q8_0  llama.cpp's own Q8_0 file of the model (`llama_model_quantize`, allow_requantize:
              llama-quantize --allow-requantize ... Q8_0), run by llama.cpp: its logits and RSS
              (the "same work on llama.cpp's own Q8_0 file"); and loaded by us: our params
              must equal our requantized ones bit for bit (the same dequantizer and quantizer)
  float64     a float64 numpy forward (tests/gguf_numpy_forward.py) of the file's dequantized
              weights: the yardstick of each side's error (relative L2 of the logits)

Reported: argmax agreement and perplexity (next-token NLL over the text) of ours against
llama.cpp's on the original file, also with `act_qtype='q8_0'` (activations quantized to 8 bits
per 32 values, as llama.cpp quantizes them for its Q8_0 / Q4_0 / Q4_1 / Q5 dot products); each side's error against float64; load time (the median of
`--load-rounds` loads a side, interleaved, each in a fresh process with the library imported
before the timer: `load_gguf` / `Llama(...)` alone) and peak RSS;
decode tokens/s of the requantized model against that of llama.cpp's Q8_0 file loaded by us
(the same shapes: bench_ab's measure). And F16: the file dequantized to an F16 GGUF,
`load_gguf(f16, quantize='q8_0')` against llama-quantize's Q8_0 of that F16 file: params bit
for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_ab import ours as ours_speed  # noqa: E402
from benchmarks.llamacpp_native import describe, query  # noqa: E402
from benchmarks.results_md import machine, section, write_section  # noqa: E402
from scripts.fetch_real_models import MODELS, cache_dir, fetch  # noqa: E402
from scripts.real_runs import (  # noqa: E402
  TEXT,
  float64_logits,
  llama,
  llama_quantize,
  nll,
  write_f16,
)
from scripts.run_json import run  # noqa: E402

OURS = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import q8rules
ids, out = json.loads(sys.argv[2]), sys.argv[3]
kw = json.loads(sys.argv[4])
t = time.perf_counter()
m = q8rules.load_gguf(sys.argv[1], dtype=jnp.float32, progress=False, **kw)
jax.block_until_ready(m.params)
load_s = time.perf_counter() - t
np.save(out, m.logits(ids))
if len(sys.argv) > 5:
  leaves = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(m.params)}
  np.savez(sys.argv[5], **leaves)
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps(dict(load_s=load_s, rss_mb=rss, requantized=dict(m.requantized))))
"""

LOAD_OURS = r"""
import json, sys, time
import jax, jax.numpy as jnp
import q8rules
load_gguf = q8rules.load_gguf  # the lazy import of q8rules.llm, outside the timer
t = time.perf_counter()
m = load_gguf(sys.argv[1], dtype=jnp.float32, progress=False)
jax.block_until_ready(m.params)
print(json.dumps(dict(load_s=time.perf_counter() - t)))
"""

LOAD_LLAMA = r"""
import json, sys, time
from llama_cpp import Llama
t = time.perf_counter()
llm = Llama(sys.argv[1], n_ctx=512, verbose=False, n_threads=2)
print(json.dumps(dict(load_s=time.perf_counter() - t)))
"""
"""Loads alone, each in a fresh process: the library imported before the timer on both sides."""


def ours(path: Path, ids: list[int], out: Path, params: Path | None = None, **kw) -> dict:
  cmd = [sys.executable, "-c", textwrap.dedent(OURS), str(path), json.dumps(ids), str(out)]
  cmd += [json.dumps(kw)] + ([str(params)] if params else [])
  return run(cmd, {"PYTHONPATH": str(ROOT)})


def load_times(py: str, path: Path, rounds: int) -> tuple[list[float], list[float]]:
  """`rounds` loads of `path` by each side, interleaved, each in a fresh process (seconds)."""
  ours_s, llama_s = [], []
  for _ in range(rounds):
    ours_s.append(run([sys.executable, "-c", LOAD_OURS, str(path)], {"PYTHONPATH": str(ROOT)}))
    llama_s.append(run([py, "-c", LOAD_LLAMA, str(path)]))
  return [r["load_s"] for r in ours_s], [r["load_s"] for r in llama_s]


def rel(a: np.ndarray, ref: np.ndarray) -> float:
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def same_params(a: Path, b: Path) -> tuple[int, int]:
  """(leaves equal bit for bit, leaves) of two saved param trees."""
  x, y = np.load(a), np.load(b)
  assert sorted(x.files) == sorted(y.files), (x.files, y.files)
  same = sum(np.array_equal(x[k].view(np.uint8), y[k].view(np.uint8)) for k in x.files)
  return same, len(x.files)


def evaluate(key: str, py: str, work: Path, load_rounds: int) -> dict:
  model = MODELS[key]
  path = fetch(model, cache_dir())
  from q8rules.checkpoint.gguf import open_gguf
  from q8rules.llm.tokenizer import GGUFTokenizer

  with open_gguf(path) as ckpt:
    meta = ckpt.metadata

  ids = GGUFTokenizer.from_metadata(meta, path=str(path)).encode(TEXT)
  q8_file = work / f"{path.stem}.llama-q8_0.gguf"
  llama_quantize(py, path, q8_file)
  f = {n: work / f"{key}-{n}.npy" for n in ("ours", "llama", "llama_q8", "ours_q8", "ours_act")}
  p = {n: work / f"{key}-{n}-params.npz" for n in ("ours", "ours_q8", "f16")}
  ours(path, ids, f["ours"])  # warms the page cache and the compilation cache
  r_ours = ours(path, ids, f["ours"], p["ours"])
  llama(py, path, ids, f["llama"])
  r_llama = llama(py, path, ids, f["llama"])
  r_llama_q8 = llama(py, q8_file, ids, f["llama_q8"])
  r_ours_q8 = ours(q8_file, ids, f["ours_q8"], p["ours_q8"])
  ours(path, ids, f["ours_act"], act_qtype="q8_0")  # activations 8-bit, as llama.cpp's dots
  ref = float64_logits(path, ids)
  lo = {n: np.load(v) for n, v in f.items()}
  f16 = work / f"{path.stem}.f16.gguf"
  f16_q8 = work / f"{path.stem}.f16.llama-q8_0.gguf"
  write_f16(path, f16)
  llama_quantize(py, f16, f16_q8)
  ours(f16, ids, work / "f16.npy", p["f16"], quantize="q8_0")
  ours(f16_q8, ids, work / "f16_q8.npy", work / "f16_q8-params.npz")
  loads_ours, loads_llama = load_times(py, path, load_rounds)
  cache = tempfile.mkdtemp(prefix="q8rules-real-")
  speed = {n: ours_speed(ROOT, fp, 2, cache) for n, fp in (("requant", path), ("q8", q8_file))}
  return dict(
    file=model.file,
    licence=model.licence,
    tokens=len(ids),
    requantized=r_ours["requantized"],
    argmax=float(np.mean(lo["ours"].argmax(-1) == lo["llama"].argmax(-1))),
    argmax_act=float(np.mean(lo["ours_act"].argmax(-1) == lo["llama"].argmax(-1))),
    ppl_act=float(np.exp(nll(lo["ours_act"], ids))),
    argmax_f64_ours=float(np.mean(lo["ours"].argmax(-1) == ref.argmax(-1))),
    argmax_f64_llama=float(np.mean(lo["llama"].argmax(-1) == ref.argmax(-1))),
    ppl_f64=float(np.exp(nll(ref, ids))),
    ppl_ours=float(np.exp(nll(lo["ours"], ids))),
    ppl_llama=float(np.exp(nll(lo["llama"], ids))),
    err_ours=rel(lo["ours"], ref),
    err_llama=rel(lo["llama"], ref),
    err_llama_q8=rel(lo["llama_q8"], ref),
    err_ours_q8=rel(lo["ours_q8"], ref),
    params_vs_llama_q8=same_params(p["ours"], p["ours_q8"]),
    f16_params_vs_llama_quantize=same_params(p["f16"], work / "f16_q8-params.npz"),
    load_ours=float(np.median(loads_ours)),
    load_llama=float(np.median(loads_llama)),
    loads_ours=loads_ours,
    loads_llama=loads_llama,
    rss_ours=r_ours["rss_mb"],
    rss_llama=r_llama["rss_mb"],
    rss_llama_q8=r_llama_q8["rss_mb"],
    rss_ours_q8=r_ours_q8["rss_mb"],
    decode_requant=speed["requant"]["decode_tps"],
    decode_q8=speed["q8"]["decode_tps"],
  )


def table(rows: list[dict]) -> str:
  cols = [
    ("file", "file"),
    ("tokens", "tokens"),
    ("argmax agreement vs llama.cpp", "argmax"),
    (
      "with act_qtype='q8_0': argmax agreement / ppl",
      lambda r: f"{r['argmax_act']:.4f} / {r['ppl_act']:.3f}",
    ),
    (
      "argmax = float64's: ours / llama.cpp",
      lambda r: f"{r['argmax_f64_ours']:.3f} / {r['argmax_f64_llama']:.3f}",
    ),
    (
      "ppl ours / llama.cpp / float64",
      lambda r: f"{r['ppl_ours']:.3f} / {r['ppl_llama']:.3f} / {r['ppl_f64']:.3f}",
    ),
    ("error vs float64: ours", "err_ours"),
    ("llama.cpp (same file)", "err_llama"),
    ("llama.cpp (its Q8_0)", "err_llama_q8"),
    ("params = llama-quantize Q8_0", lambda r: "{}/{}".format(*r["params_vs_llama_q8"])),
    (
      "F16 quantize='q8_0' = llama-quantize",
      lambda r: "{}/{}".format(*r["f16_params_vs_llama_quantize"]),
    ),
    (
      "load s ours / llama.cpp (median of fresh processes)",
      lambda r: (
        f"{r['load_ours']:.3f} / {r['load_llama']:.3f} = {r['load_ours'] / r['load_llama']:.1f}x"
      ),
    ),
    (
      "peak RSS MB ours: this file / llama.cpp's Q8_0 file",
      lambda r: f"{r['rss_ours']:.0f} / {r['rss_ours_q8']:.0f}",
    ),
    (
      "peak RSS MB llama.cpp: this file / its Q8_0 file",
      lambda r: f"{r['rss_llama']:.0f} / {r['rss_llama_q8']:.0f}",
    ),
    (
      "decode tok/s requantized / Q8_0 file",
      lambda r: f"{r['decode_requant']:.1f} / {r['decode_q8']:.1f}",
    ),
  ]
  head = "| " + " | ".join(c for c, _ in cols) + " |"
  out = [head, "|" + "---|" * len(cols)]
  for r in rows:
    cells = []
    for _, k in cols:
      v = k(r) if callable(k) else r[k]
      cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--llama-cpp-python", required=True)
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "q8rules-real"))
  ap.add_argument("--load-rounds", type=int, default=7, help="fresh-process loads a side")
  ap.add_argument("--write", action="store_true", help="write the table into RESULTS.md")
  args = ap.parse_args()
  build, missing = describe(**query(args.llama_cpp_python))
  print(build, flush=True)
  if missing:
    raise SystemExit(f"the llama.cpp build lacks {missing}: not native, no comparison")
  work = Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  rows = []
  for key in args.models.split(","):
    rows.append(evaluate(key, args.llama_cpp_python, work, args.load_rounds))
    print(json.dumps(rows[-1]), flush=True)
  text = table(rows)
  print(text)
  if args.write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = f"{when}. Machine: {machine()}. {build}"
    notes = "\n".join(
      f"- {r['file']} ({r['licence']}): {r['tokens']} tokens; requantized {r['requantized']};"
      f" ours on llama.cpp's Q8_0 file vs float64 {r['err_ours_q8']:.3g}; loads (s), ours"
      f" {' '.join(f'{v:.3f}' for v in r['loads_ours'])}, llama.cpp"
      f" {' '.join(f'{v:.3f}' for v in r['loads_llama'])}"
      for r in rows
    )
    cmd = "python benchmarks/real_gguf.py --llama-cpp-python PY --write"
    heading = "## Real GGUF files served as Q8_0, against llama.cpp"
    write_section("real-gguf", section("real-gguf", heading, header, cmd, [text, notes]))


if __name__ == "__main__":
  main()
