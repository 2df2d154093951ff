"""Decode tokens/s of a GGUF model under `nn.scan` (as loaded) and unrolled
(`q8rules.llm.unstack.unrolled`), interleaved in one process, plus the compile time of each.

    python benchmarks/bench_unrolled.py /tmp/bench-8l-q8_0.gguf [--rounds 3] [--write]

(the files of `benchmarks/bench_decode.py`). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import q8rules  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from q8rules.llm.unstack import unrolled  # noqa: E402

PROMPT = [0, 41, 70, 77, 77, 80, 222, 88]


def decode_tps(m, n: int = 33) -> float:
  stamps = []
  for _ in m.stream(PROMPT, n):
    stamps.append(time.perf_counter())
  return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args()
  rows = []
  for f in args.files:
    m = q8rules.load_gguf(f, dtype=jnp.float32, progress=False)
    t = time.perf_counter()
    u = unrolled(m)
    jax.block_until_ready(u.params)
    split_s = time.perf_counter() - t
    first = {}
    for name, mm in (("scanned", m), ("unrolled", u)):
      t = time.perf_counter()
      list(mm.stream(PROMPT, 17))  # traces and compiles prefill, first token, the loop
      first[name] = time.perf_counter() - t
    diff = float(np.abs(m.logits(PROMPT) - u.logits(PROMPT)).max())
    same = m.generate(PROMPT, 16) == u.generate(PROMPT, 16)
    tps = {"scanned": [], "unrolled": []}
    for _ in range(args.rounds):
      for name, mm in (("scanned", m), ("unrolled", u)):
        tps[name].append(decode_tps(mm))
    s, r = statistics.median(tps["scanned"]), statistics.median(tps["unrolled"])
    rows.append(
      f"| {Path(f).name} ({m.config.layers} layers, dim {m.config.dim}) | {s:.1f} | {r:.1f} |"
      f" **{r / s:.2f}x** | {first['scanned']:.1f} | {first['unrolled']:.1f} | {split_s:.2f} |"
      f" {diff:.1e} | {same} |"
    )
    print(rows[-1], flush=True)
  table = "\n".join(
    [
      "| file | decode tok/s, scanned | unrolled | unrolled / scanned | first stream (trace +"
      " compile), scanned s | unrolled s | splitting the weights s | max abs logit diff |"
      " same greedy tokens |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---|",
      *rows,
    ]
  )
  print(table)
  print(f"load average at the end: {load_average()}")
  if args.write:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    header = (
      f"Date: {now}. Machine: {machine()}. Load average at the end: {load_average()} (shared"
      f" 2-core machine). Medians of {args.rounds} interleaved rounds of 32 decode steps, 2"
      " threads, float32 activations, compilation cache off."
    )
    cmd = "python " + " ".join(["benchmarks/bench_unrolled.py", *sys.argv[1:]])
    write_section(
      "unrolled",
      section(
        "unrolled", "## Scanned vs unrolled layers, CPU decode (issue 21)", header, cmd, [table]
      ),
    )


if __name__ == "__main__":
  main()
