"""Decode with the products' helper threads spinning for the next product for different times
(`$Q8RULES_SPIN_US`), on bench_decode.py's files, all CPUs of this process.

    python benchmarks/bench_spin.py [--files cb] [--spins 0,200,1000] [--rounds 5] [--write]

A product runs on the caller and the library's helper threads (docs/kernels.md, "Threads"):
after a product each helper spins `$Q8RULES_SPIN_US` microseconds for the next one, then
sleeps until a product wakes it (a condition variable). At 0 every product wakes its helpers
from sleep, as a thread pool's wake-up does; at 200 (the default) a decode step's products, a
few microseconds apart, find them spinning. Each run is a fresh interpreter (a warm
compilation cache) loading the file (float32 activations) and timing `GGUFModel.stream` over
128 tokens, best of 3; the spin times interleave within each round, and the table gives each
one's median over the rounds, the bytes a step reads over that time, its share of the read
bandwidth at the same threads (`bandwidth.py`, best of a probe before and after), and the
median over rounds of its ratio to the first spin time's run of the same round.
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
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bandwidth import read_bandwidth  # noqa: E402
from benchmarks.bench_decode import FILES, PROMPT, bytes_per_token  # noqa: E402
from benchmarks.bench_gguf import make_file  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

NEW = 129  # the first token and 128 decode steps

CHILD = r"""
import json, sys, time
import jax.numpy as jnp
import q8rules
from q8rules.llm import compile_cache
compile_cache.enable()
m = q8rules.load_gguf(sys.argv[1], dtype=jnp.float32, progress=False)
prompt, n = json.loads(sys.argv[2]), int(sys.argv[3])
best = 0.0
for _ in range(3):
  stamps = [time.perf_counter() for _ in m.stream(prompt, n)]
  best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
print(json.dumps({"decode_tps": best}))
"""


def decode(path: Path, spin: int, env: dict[str, str]) -> float:
  """Decode tokens/s of one fresh process with $Q8RULES_SPIN_US = spin."""
  cmd = [sys.executable, "-c", textwrap.dedent(CHILD), str(path), json.dumps(PROMPT), str(NEW)]
  env = {**os.environ, **env, "Q8RULES_SPIN_US": str(spin), "PYTHONPATH": str(ROOT)}
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
  if out.returncode != 0:
    raise RuntimeError(f"decode of {path.name} (spin {spin} us) failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])["decode_tps"]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--dir", default="/tmp", help="where bench_decode's GGUF files are (written once)"
  )
  ap.add_argument("--files", default="cb", help="bench_decode.py's file keys")
  ap.add_argument("--spins", default="0,200,1000", help="spin times, microseconds")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--write", action="store_true", help="write RESULTS.md's `helpers` section")
  args = ap.parse_args()
  spins = [int(s) for s in args.spins.split(",")]
  threads = len(os.sched_getaffinity(0))
  env = {"Q8RULES_COMPILE_CACHE": tempfile.mkdtemp(prefix="q8rules-bench-cc-")}
  probes = [read_bandwidth(threads, gib=2.0)]
  runs: dict[tuple[str, int], list[float]] = {}
  paths = {}
  for key in args.files:
    name, shapes, vocab, tied = FILES[key]
    paths[key] = Path(args.dir) / name
    if not paths[key].exists():
      make_file(paths[key], shapes, vocab, tied)
    decode(paths[key], spins[0], env)  # fills the compilation cache
  for r in range(args.rounds):
    for key in args.files:
      for spin in spins:
        tps = decode(paths[key], spin, env)
        runs.setdefault((key, spin), []).append(tps)
        print(key, spin, r, f"{tps:.1f} tokens/s", f"load {load_average()}", flush=True)
  probes.append(read_bandwidth(threads, gib=2.0))
  probe = max(probes)
  lines = [
    f"| file | $Q8RULES_SPIN_US | decode tokens/s (median of {args.rounds}) | GB/s read"
    f" (of the {probe:.1f} GB/s probe) | ratio to {spins[0]} us (median of rounds) |",
    "|---|---:|---:|---:|---:|",
  ]
  for key in args.files:
    step = bytes_per_token(paths[key])
    base = runs[(key, spins[0])]
    for spin in spins:
      tps = runs[(key, spin)]
      gbs = statistics.median(tps) * step / 1e9
      ratio = statistics.median(t / b for t, b in zip(tps, base, strict=True))
      lines.append(
        f"| {FILES[key][0]} ({FILES[key][1].name}) | {spin} | {statistics.median(tps):.1f}"
        f" ({min(tps):.1f}-{max(tps):.1f}) | {gbs:.1f} ({gbs / probe:.0%}) | {ratio:.2f}x |"
      )
  table = "\n".join(lines)
  print(table)
  if args.write:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
      f"{stamp}. Machine: {machine()}, {threads} threads. Read bandwidth (`bandwidth.py`,"
      f" 2 GiB, {threads} threads): {', '.join(f'{p:.1f}' for p in probes)} GB/s."
      f" Load average at the end: {load_average()}."
    )
    command = (
      f"python benchmarks/bench_spin.py --files {args.files} --spins {args.spins}"
      f" --rounds {args.rounds} --write"
    )
    text = section(
      "helpers", "## Decode and the helper threads' spin time (CPU)", header, command, [table]
    )
    write_section("helpers", text)


if __name__ == "__main__":
  main()
