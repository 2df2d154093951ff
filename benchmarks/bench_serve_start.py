"""`q8rules serve`'s start: the seconds from the command to the model loaded, to the port
listening, to /health answering 200 and to the first answer of a short chat completion, with
JAX's persistent compilation cache off, cold (an empty cache) and warm (the cache the cold start
filled).

    python benchmarks/bench_serve_start.py MODEL.gguf [--base REF] [--rounds 3] [--threads 2]
        [--parallel 4] [--ctx C] [--write]

Each start is a fresh `python -m q8rules serve MODEL --no-progress` (the command's defaults
otherwise: 4 slots, the model's context up to 4,096 positions a slot), timed from its launch:

  loaded      the model line on stderr ('...; compiling, then serving on ...'): imports and
              `load_gguf` done
  listening   a TCP connection to the port is accepted
  /health ok  GET /health answers 200
  first answer  a chat completion of one short user turn (greedy, 8 tokens, not streamed) has
              its whole answer

Modes: 'off' (`Q8RULES_NO_COMPILE_CACHE=1`: everything compiled), 'cold' (`Q8RULES_COMPILE_CACHE`
a new empty folder: everything compiled and written there) and 'warm' (the folder the cold start
of the same round filled: the programs read back). With `--base REF` the same starts also run
from that commit (exported with `git archive`, as `bench_serve_ab.py` does) in each round,
before this checkout's, for a before/after table. One untimed start per tree comes first (the
page cache holds the file and the Python sources, and the native library is built). Before
each start the script waits, up to `--quiet-wait` seconds, for no other task wanting a CPU for
2 s; medians and the spread over the rounds are reported, with the programs each mode wrote to
the cache.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_serve_ab import export  # noqa: E402
from benchmarks.bench_serve_vs_llama_server import code_version, wait_quiet  # noqa: E402
from benchmarks.results_md import load_average, publish  # noqa: E402
from q8rules.serve import free_port  # noqa: E402

MODES = ("off", "cold", "warm")
STAGES = ("loaded", "listening", "health", "answer")
"""What each start times, in the order they come."""

LOADED = "compiling, then serving on"
"""The stderr line `q8rules serve` prints once the model is loaded."""

CHAT = {
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 8,
  "temperature": 0,
}


def env_of(mode: str, cache: Path, tree: Path) -> dict[str, str]:
  """The environment of a start in `mode` (the cache folder `cache` for cold and warm), q8rules
  imported from `tree`."""
  env = {k: v for k, v in os.environ.items() if k not in ("Q8RULES_NO_COMPILE_CACHE",)}
  env.update(PYTHONPATH=str(tree), Q8RULES_COMPILE_CACHE=str(cache))
  if mode == "off":
    env["Q8RULES_NO_COMPILE_CACHE"] = "1"
  return env


def accepts(port: int) -> bool:
  """Whether 127.0.0.1:`port` accepts a TCP connection now."""
  with socket.socket() as s:
    s.settimeout(0.5)
    return s.connect_ex(("127.0.0.1", port)) == 0


def one_start(cmd: list[str], env: dict, tree: Path, port: int, timeout: float) -> dict[str, float]:
  """Launch `cmd` and time its stages (seconds since the launch); the process is stopped after
  the first answer."""
  url = f"http://127.0.0.1:{port}"
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tree
  )
  times: dict[str, float] = {}
  lines: list[str] = []

  def read() -> None:
    for line in proc.stderr:
      lines.append(line)
      if LOADED in line:
        times.setdefault("loaded", time.perf_counter() - t0)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    while "health" not in times:
      if proc.poll() is not None or time.perf_counter() - t0 > timeout:
        raise RuntimeError(f"{' '.join(cmd)} did not start:\n{''.join(lines)[-3000:]}")
      if "listening" not in times and accepts(port):
        times["listening"] = time.perf_counter() - t0
      if "listening" in times:
        try:
          if httpx.get(url + "/health", timeout=5).status_code == 200:
            times["health"] = time.perf_counter() - t0
        except httpx.HTTPError:
          pass
      time.sleep(0.02)
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=timeout)
    r.raise_for_status()
    times["answer"] = time.perf_counter() - t0
  finally:
    proc.terminate()
    try:
      proc.wait(60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    reader.join(5)
  return times


def cached_programs(cache: Path) -> int:
  """The compiled programs in the cache folder `cache` (one entry each)."""
  return sum(1 for p in cache.iterdir() if not p.name.endswith("-atime")) if cache.exists() else 0


def spread(xs: list[float]) -> str:
  """'median (min-max)' of `xs` seconds."""
  return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("model", help="a GGUF file (e.g. SmolLM2-135M-Instruct.Q8_0.gguf)")
  p.add_argument("--base", default=None, help="a commit to time too (before / after)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--threads", type=int, default=None, help="serve's --threads (None: all CPUs)")
  p.add_argument("--parallel", type=int, default=None, help="serve's --parallel (None: its 4)")
  p.add_argument("--ctx", type=int, default=None, help="serve's --ctx (None: its default)")
  p.add_argument("--timeout", type=float, default=600.0, help="the most seconds a start may take")
  p.add_argument("--quiet-wait", type=float, default=30.0,
                 help="the most seconds to wait for a quiet machine before a start")  # fmt: skip
  p.add_argument("--write", action="store_true", help="write the section of RESULTS.md")
  args = p.parse_args()
  model = str(Path(args.model).resolve())
  extra = [f"--{k}={v}" for k, v in (("threads", args.threads), ("parallel", args.parallel),
                                      ("ctx", args.ctx)) if v is not None]  # fmt: skip
  with tempfile.TemporaryDirectory(prefix="bench_serve_start_") as tmp:
    trees = {"this checkout": ROOT}
    if args.base:
      (Path(tmp) / "base").mkdir()
      sha = export(args.base, Path(tmp) / "base")
      trees = {f"base {sha}": Path(tmp) / "base" / "tree", **trees}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    written: dict[tuple[str, str], list[int]] = {}
    loads: list[str] = []
    quiet = 0
    for r in range(-1, args.rounds):  # round -1: one untimed start a tree
      for i, (name, tree) in enumerate(trees.items()):
        cache = Path(tmp) / f"cache-{r}-{i}"
        for mode in MODES if r >= 0 else ("off",):
          port = free_port()
          cmd = [sys.executable, "-m", "q8rules", "serve", model, "--port", str(port),
                 "--no-progress", *extra]  # fmt: skip
          quiet += wait_quiet(args.quiet_wait) if r >= 0 else 0
          loads.append(load_average())
          before = cached_programs(cache)
          times = one_start(cmd, env_of(mode, cache, tree), tree, port, args.timeout)
          if r < 0:
            print(f"{name}: untimed start {times['answer']:.1f} s", flush=True)
            continue
          results.setdefault((name, mode), []).append(times)
          written.setdefault((name, mode), []).append(cached_programs(cache) - before)
          print(
            f"round {r} {name} {mode:4s}: "
            + ", ".join(f"{s} {times[s]:.1f} s" for s in STAGES)
            + f"; {written[(name, mode)][-1]} programs written to the cache; load {loads[-1]}",
            flush=True,
          )
  rows = []
  for (name, mode), runs in results.items():
    cells = " | ".join(spread([t[s] for t in runs]) for s in STAGES)
    rows.append(f"| {name} | {mode} | {cells} | {statistics.median(written[(name, mode)]):.0f} |")
  table = "\n".join(
    [
      "| code | compilation cache | loaded s | listening s | /health ok s | first answer s"
      " | programs written to the cache |",
      "|---|---|---:|---:|---:|---:|---:|",
      *rows,
    ]
  )
  starts = sum(len(v) for v in results.values())
  blocks = [
    table,
    f"Medians (min-max) of {args.rounds} rounds, seconds from the command's launch. {quiet} of"
    f" {starts} starts began on a quiet machine (no other task wanting a CPU for 2 s;"
    f" `--quiet-wait {args.quiet_wait:g}`); load averages before them:"
    f" {', '.join(sorted(set(loads))[:3])} ... {', '.join(sorted(set(loads))[-3:])}.",
  ]
  header = (
    f"Model: {Path(args.model).name}; `q8rules serve` with {' '.join(extra) or 'its defaults'}."
    f" Code: {code_version()}."
  )
  heading = "## `q8rules serve`'s start, to its first answer (`benchmarks/bench_serve_start.py`)"
  publish("serve-start", heading, header, blocks, args.write)


if __name__ == "__main__":
  main()
