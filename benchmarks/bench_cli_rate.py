"""The decode rate `q8rules run` prints against bench_decode.py's measure on the same file.

    python benchmarks/bench_cli_rate.py [--file c] [--threads 1] [--rounds 4] [--write]

Each run is a fresh process on the same CPUs (`--threads 1`: `taskset -c 0`), rounds
interleaved: the CLI (`q8rules run FILE --ids PROMPT -n 65`, its stderr's decode tokens/s,
counted after the decode loop's first chunk: q8rules/cli/rates.py) and bench_decode's measure
(bench_ab.py's script: a warmed-up device loop, 64 tokens after the first, the best of two).
Both with a warm compilation cache.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_ab import ours  # noqa: E402
from benchmarks.bench_decode import FILES, NEW, PROMPT, pin  # noqa: E402
from benchmarks.bench_gguf import make_file  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

RATE = re.compile(r"decode: ([\d.]+) generated tokens/s over (\d+) tokens")


def cli_rate(path: Path, threads: int, cache: str) -> float:
  ids = ",".join(map(str, PROMPT))
  cmd = [sys.executable, "-m", "q8rules", "run", str(path), "--ids", ids, "-n", str(NEW)]
  env = {**os.environ, "PYTHONPATH": str(ROOT), "Q8RULES_COMPILE_CACHE": cache}
  proc = subprocess.run(
    [*pin(threads), *cmd, "--no-progress"], capture_output=True, text=True, env=env
  )
  m = RATE.search(proc.stderr)
  if proc.returncode or m is None:
    raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr[-2000:]}")
  return float(m.group(1))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--file", default="c", choices=sorted(FILES))
  ap.add_argument("--dir", default="/tmp")
  ap.add_argument("--threads", type=int, default=1)
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args()
  name, shapes, vocab, tied = FILES[args.file]
  path = Path(args.dir) / name
  if not path.exists():
    make_file(path, shapes, vocab, tied)
  cache = tempfile.mkdtemp(prefix="q8rules-cli-rate-")
  cli_rate(path, args.threads, cache)  # fills the compilation cache
  ours(ROOT, path, args.threads, cache)
  cli, bench = [], []
  for r in range(args.rounds):
    for side in ("cli", "bench") if r % 2 == 0 else ("bench", "cli"):
      if side == "cli":
        cli.append(cli_rate(path, args.threads, cache))
      else:
        bench.append(ours(ROOT, path, args.threads, cache)["decode_tps"])
    print(f"round {r}: cli {cli[-1]:.1f}, bench_decode {bench[-1]:.1f}; load {load_average()}")
  c, b = statistics.median(cli), statistics.median(bench)
  table = "\n".join(
    [
      "| file | threads | `q8rules run` decode tok/s (runs) | bench_decode tok/s (runs) | ratio |",
      "|---|---|---|---|---|",
      f"| {args.file} | {args.threads} | {c:.1f} ({', '.join(f'{x:.1f}' for x in cli)})"
      f" | {b:.1f} ({', '.join(f'{x:.1f}' for x in bench)}) | {c / b:.3f} |",
    ]
  )
  print(table)
  if args.write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = f"{when}. Machine: {machine()}. Medians of {args.rounds} interleaved runs each."
    cmd = f"python benchmarks/bench_cli_rate.py --file {args.file} --threads {args.threads} --write"
    heading = "## The CLI's decode rate against bench_decode's"
    write_section("cli-rate", section("cli-rate", heading, header, cmd, [table]))


if __name__ == "__main__":
  main()
