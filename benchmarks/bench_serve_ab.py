"""`q8rules serve` of two commits, A and B, on the same model: decode tokens/s with 1 and 4
streams, to show a change left the serving path's speed as it was.

    python benchmarks/bench_serve_ab.py MODEL.gguf --base 560c132 [--parallel 1,4 --rounds 5
        --threads 2 --write]

A is `--base`, exported with `git archive` into a temporary directory (the repository is not
touched); B is this checkout. Per `--parallel N`, both servers run side by side on loopback
ports (`q8rules serve --parallel N --threads T --ctx C`, each from its own tree), each idle
while the other is measured, in interleaved rounds (A then B, then B then A, ...), after one
unmeasured warm-up measurement a server. A measurement is bench_serve_vs_llama_server's: N
streamed greedy text completions of 128 tokens at once (`ignore_eos`), the aggregate decode
rate while all N decode, per stream, and end to end. Before each it waits, up to --quiet-wait
seconds, for no other task wanting a CPU for 2 s; the medians, the ratio B / A of the medians
and the median of each round's ratio (the two runs of a round are seconds apart, so a machine
shared with other work slows them alike) are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_serve_vs_llama_server import TOKENS, code_version, fmt, measure  # noqa: E402
from benchmarks.bench_serve_vs_llama_server import start as start_server  # noqa: E402
from benchmarks.results_md import publish  # noqa: E402
from q8rules.serve import free_port  # noqa: E402


def export(ref: str, dest: Path) -> str:
  """The tree of commit `ref` written under `dest` (git archive); its short hash."""
  sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True,
                       capture_output=True, text=True).stdout.strip()  # fmt: skip
  archive = dest / "tree.tar"
  subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref], check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(dest / "tree", filter="data")
  return sha


def start(tree: Path, args: argparse.Namespace, model: str, n: int, log: Path) -> tuple:
  """`q8rules serve` from `tree` with `n` slots, once /health answers: (process, url)."""
  port = free_port()
  cmd = [sys.executable, "-m", "q8rules", "serve", model, "--port", str(port), "--parallel",
         str(n), "--threads", str(args.threads), "--ctx", str(args.ctx), "--no-progress"]  # fmt: skip
  url = f"http://127.0.0.1:{port}"
  return start_server(cmd, log, url, tree=tree), url


def imported_from(tree: Path) -> str:
  """Where `import q8rules` resolves to when run as the servers are (cwd and PYTHONPATH the
  tree)."""
  out = subprocess.run(
    [sys.executable, "-c", "import q8rules; print(q8rules.__file__)"], cwd=tree,
    env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True,
  )  # fmt: skip
  return out.stdout.strip()


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("model", help="a GGUF file")
  p.add_argument("--base", required=True, help="commit A (B is this checkout)")
  p.add_argument("--parallel", default="1,4", help="the slot counts, comma-separated")
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--ctx", type=int, default=256, help="positions per slot")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--quiet-wait", type=float, default=60.0,
                 help="the most seconds to wait for a quiet machine before a measurement")  # fmt: skip
  p.add_argument("--write", action="store_true", help="write the section of RESULTS.md")
  args = p.parse_args()
  model = str(Path(args.model).resolve())
  counts = [int(x) for x in args.parallel.split(",")]
  rows, loads, noisy, total = [], set(), 0, 0
  with tempfile.TemporaryDirectory() as tmp:
    base = export(args.base, Path(tmp))
    trees = {"A": Path(tmp) / "tree", "B": ROOT}
    for side, tree in trees.items():
      where = imported_from(tree)
      if not where.startswith(str(tree)):
        raise SystemExit(f"{side}: q8rules imports from {where}, not {tree}")
    for n in counts:
      servers = {}
      results: dict[str, list] = {"A": [], "B": []}
      ratios = []
      try:
        for side, tree in trees.items():
          log = Path(tmp) / f"serve_{side}_{n}.log"
          servers[side] = start(tree, args, model, n, log)
          measure(servers[side][1], n, 8)  # warm-up
        for r in range(args.rounds):
          order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
          got = {}
          for side in order:
            m = measure(servers[side][1], n, TOKENS, args.quiet_wait)
            got[side] = m
            results[side].append(m)
            loads.add(m.load)
            noisy += not m.quiet
            total += 1
            print(f"  parallel {n} round {r}: {side} aggregate {m.aggregate:6.1f}, per stream"
                  f" {m.per_stream:6.1f} tok/s; load {m.load}", flush=True)  # fmt: skip
          ratios.append(got["B"].aggregate / got["A"].aggregate)
      finally:
        for proc, _ in servers.values():
          proc.terminate()
          proc.wait(60)
      a = [m.aggregate for m in results["A"]]
      b = [m.aggregate for m in results["B"]]
      rows.append(
        f"| {n} | {fmt(a)} | {fmt(b)} | **{statistics.median(b) / statistics.median(a):.3f}x** |"
        f" {statistics.median(ratios):.3f}x ({', '.join(f'{x:.2f}' for x in ratios)}) |"
        f" {fmt([m.per_stream for m in results['A']])} |"
        f" {fmt([m.per_stream for m in results['B']])} |"
      )
  table = "\n".join(
    [
      f"| streams | A ({base}): aggregate decode tok/s, median (runs) | B: the same | B / A,"
      " medians | B / A per round, median (rounds) | A: per stream | B: per stream |",
      "|---|---|---|---|---|---|---|",
      *rows,
    ]
  )
  blocks = [
    table,
    f"{total - noisy} of {total} measurements started on a quiet machine (no other task wanting"
    f" a CPU for 2 s; `--quiet-wait {args.quiet_wait:g}`). Load averages before them:"
    f" {'; '.join(sorted(loads))}.",
  ]
  header = (
    f"Model: {Path(args.model).name}; {args.threads} threads; {TOKENS} greedy tokens a stream"
    f" (`ignore_eos`); {args.ctx} positions a slot; {args.rounds} interleaved rounds. A: {base};"
    f" B: {code_version()}."
  )
  heading = "## q8rules serve, one commit against another (`benchmarks/bench_serve_ab.py`)"
  publish("serve-ab", heading, header, blocks, args.write)


if __name__ == "__main__":
  main()
