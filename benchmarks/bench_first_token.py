"""The first token of a GGUF model after `import q8rules` returns, in fresh processes with warm
caches: what a user waits for between the import and the first generated token.

    python benchmarks/bench_first_token.py [--file /tmp/bench-135m-q8_0.gguf] [--runs 7] [--write]

Each run is a fresh interpreter that times `import q8rules`, then, from the moment it returns:
`q8rules.llm.enable_compile_cache()` (as `python -m q8rules run` does), `load_gguf(file)`, and
`stream(prompt, 1)` up to its first token (the prompt's prefill, the head, the first sample).
The page cache holds the file and the compilation cache the programs (one untimed run fills
both). Reported: medians and the spread of the runs, with the load and what follows it apart.
The default file is `bench_decode.py`'s c (SmolLM-135M's shapes, written there once).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

PROMPT = [0, 41, 70, 77, 77, 80, 222, 88]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import q8rules
t1 = time.perf_counter()
q8rules.llm.enable_compile_cache()
m = q8rules.load_gguf(sys.argv[1], progress=False)
import jax
jax.block_until_ready(m.params)
t2 = time.perf_counter()
first = next(iter(m.stream(json.loads(sys.argv[2]), 1)))
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1, after_load_s=t3 - t2,
                      first_token_s=t3 - t1, token=int(first))))
"""


def one(path: str, cache: str) -> dict:
  env = {"Q8RULES_COMPILE_CACHE": cache, "PYTHONPATH": str(ROOT)}
  out = subprocess.run(
    [sys.executable, "-c", CHILD, path, json.dumps(PROMPT)],
    capture_output=True,
    text=True,
    env={**os.environ, **env},
    timeout=600,
  )
  if out.returncode:
    raise RuntimeError(out.stderr[-3000:])
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--file", default="/tmp/bench-135m-q8_0.gguf")
  ap.add_argument("--runs", type=int, default=7)
  ap.add_argument("--write", action="store_true", help="write RESULTS.md's `first-token`")
  args = ap.parse_args()
  path = Path(args.file)
  if not path.exists():
    from benchmarks.bench_decode import FILES
    from benchmarks.bench_gguf import make_file

    _, shapes, vocab, tied = FILES["c"]
    make_file(path, shapes, vocab, tied)
  cache = tempfile.mkdtemp(prefix="q8rules-first-token-")
  one(str(path), cache)  # fills the compilation cache and the page cache
  runs = [one(str(path), cache) for _ in range(args.runs)]
  keys = ("import_s", "load_s", "after_load_s", "first_token_s")
  med = {k: statistics.median(r[k] for r in runs) for k in keys}
  spread = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in keys}
  table = "\n".join(
    [
      "| file | runs | import q8rules s | load s | load to first token s |"
      " first token after import s (target 1.0) |",
      "|---|---:|---:|---:|---:|---:|",
      f"| {path.name} | {len(runs)} | "
      + " | ".join(f"{med[k]:.2f} ({spread[k][0]:.2f}-{spread[k][1]:.2f})" for k in keys)
      + " |",
    ]
  )
  print(table)
  if args.write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = f"{when}. Machine: {machine()}. Load average at the end: {load_average()}."
    cmd = "python benchmarks/bench_first_token.py --write"
    notes = (
      "Medians (and the spread) of fresh processes with warm page and compilation caches;"
      " 'first token after import' runs from `import q8rules` returning to the first token:"
      " the compile cache switched on, `load_gguf`, the prompt's prefill and the first sample."
    )
    heading = "## First token after `import q8rules` (CPU, 135M model)"
    write_section("first-token", section("first-token", heading, header, cmd, [table, notes]))


if __name__ == "__main__":
  main()
