"""Two checkouts of q8rules, A and B, against each other and against a native llama.cpp, on
bench_decode.py's GGUF files (`file_path`: the synthetic a, b, c and the real Gemma 3 270M g, h):
a refactor's proof that it costs no speed, or a change's gain.

    python benchmarks/bench_ab.py --a /path/to/old/checkout --b . \
        --llama-cpp-python /work/venv-llamacpp/bin/python --files cb --threads 2 --rounds 3

Each measurement is a fresh interpreter on one checkout (its own `PYTHONPATH`), the same files,
the same CPUs, the same warm compilation cache per side; rounds interleave A, B and llama.cpp so
the machine's drift falls on all three alike. Per run: load time, decode tokens/s (the device
loop, 64 tokens after the first, the best of two passes; bench_decode.py's measure) and
128-token prefill tokens/s. The table gives medians, B / A, and each side / llama.cpp. With
`--idle F` each run first waits (up to `--idle-wait` seconds) until the CPUs are at least F idle
over a second, so that other jobs on a shared machine fall on fewer runs; the idle fraction seen
is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_decode import NEW, PROMPT, file_path, pin, theirs  # noqa: E402
from benchmarks.llamacpp_native import describe, query  # noqa: E402
from benchmarks.results_md import load_average, machine, wait_for_idle  # noqa: E402
from scripts.run_json import run  # noqa: E402

OURS = r"""
import json, sys, time
import jax, jax.numpy as jnp
import q8rules
from q8rules.llm import compile_cache
compile_cache.enable()  # the same warm cache on both sides, whether or not load_gguf enables it
prompt, n_new = json.loads(sys.argv[2]), int(sys.argv[3])
t = time.perf_counter()
m = q8rules.load_gguf(sys.argv[1], dtype=jnp.float32, progress=False)
jax.block_until_ready(m.params)
load_s = time.perf_counter() - t
def device_loop():
  stamps = [time.perf_counter() for _ in m.stream(prompt, n_new)]
  return (len(stamps) - 1) / (stamps[-1] - stamps[0])
device_loop()  # compiles (or fetches from the cache)
decode_tps = max(device_loop() for _ in range(2))
long = [(7 * i + 3) % m.config.vocab for i in range(128)]
times = []
for _ in range(3):  # the first call compiles
  t = time.perf_counter()
  jax.block_until_ready(m.prefill(long))
  times.append(time.perf_counter() - t)
print(json.dumps(dict(load_s=load_s, decode_tps=decode_tps, prefill_tps=128 / min(times[1:]))))
"""


def ours(root: Path, path: Path, threads: int, cache: str) -> dict:
  cmd = [sys.executable, "-c", textwrap.dedent(OURS), str(path), json.dumps(PROMPT), str(NEW)]
  env = {"PYTHONPATH": str(root), "Q8RULES_COMPILE_CACHE": cache, "Q8RULES_NO_COMPILE_CACHE": ""}
  return run([*pin(threads), *cmd], env)


def table(results: dict, files: str, threads: list[int], sides: list[str]) -> str:
  keys = ("load_s", "decode_tps", "prefill_tps")
  head = "| file | threads | measure | " + " | ".join(sides) + " | B / A |"
  for side in sides[:2]:
    head += f" {side} / llama.cpp |" if "llama.cpp" in sides else ""
  rows = [head, "|" + "---|" * (head.count("|") - 1)]
  for f in files:
    for t in threads:
      for k in keys:
        med = {s: statistics.median(r[k] for r in results[(f, t, s)]) for s in sides}
        cells = [f"{med[s]:.3f}" if k == "load_s" else f"{med[s]:.1f}" for s in sides]
        row = f"| {f} | {t} | {k} | " + " | ".join(cells) + f" | {med['B'] / med['A']:.3f} |"
        if "llama.cpp" in sides:
          row += "".join(f" {med[s] / med['llama.cpp']:.3f} |" for s in ("A", "B"))
        rows.append(row)
  return "\n".join(rows)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--a", required=True, help="checkout A (the baseline)")
  ap.add_argument("--b", default=str(ROOT), help="checkout B (the change)")
  ap.add_argument("--llama-cpp-python", default=None)
  ap.add_argument("--dir", default="/tmp")
  ap.add_argument("--files", default="cb")
  ap.add_argument("--threads", default="2")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument(
    "--idle",
    type=float,
    default=0.0,
    help="before each run, wait (up to --idle-wait s) until the CPUs are this idle (0 to 1)",
  )
  ap.add_argument("--idle-wait", type=float, default=300.0)
  args = ap.parse_args()
  threads = [int(t) for t in args.threads.split(",")]
  if args.llama_cpp_python:
    build, missing = describe(**query(args.llama_cpp_python))
    print(build, flush=True)
    if missing:
      raise SystemExit(f"the llama.cpp build lacks {missing}: not native, no ratio")
  roots = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
  caches = {s: tempfile.mkdtemp(prefix=f"q8rules-ab-{s}-") for s in roots}
  sides = ["A", "B"] + (["llama.cpp"] if args.llama_cpp_python else [])
  results: dict[tuple[str, int, str], list[dict]] = {}
  for f in args.files:
    path = file_path(f, Path(args.dir), args.llama_cpp_python)
    for s, root in roots.items():  # fills each side's compilation cache
      ours(root, path, max(threads), caches[s])
    for r in range(args.rounds):
      for t in threads:
        for s in sides if r % 2 == 0 else sides[::-1]:
          idle = wait_for_idle(args.idle, args.idle_wait) if args.idle else None
          res = (
            theirs(args.llama_cpp_python, path, t)
            if s == "llama.cpp"
            else ours(roots[s], path, t, caches[s])
          )
          results.setdefault((f, t, s), []).append(res)
          note = f" idle before {idle:.2f}" if idle is not None else ""
          print(f, t, s, r, json.dumps(res), f"load {load_average()}{note}", flush=True)
  print(f"\nMachine: {machine()}. A = {roots['A']}, B = {roots['B']}. CPUs: {os.cpu_count()}.")
  print(table(results, args.files, threads, sides))


if __name__ == "__main__":
  main()
