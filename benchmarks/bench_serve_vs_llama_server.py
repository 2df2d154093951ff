"""`q8rules serve` against llama.cpp's `llama-server` on the same Q8_0 file: decode tokens/s with
1, 4 and 8 streams, and our single stream against `q8rules run`'s decode rate.

    python benchmarks/bench_serve_vs_llama_server.py MODEL-Q8_0.gguf \\
        --llama-server /path/to/llama-server [--parallel 1,4,8 --threads 2 --rounds 3 --write]

Per `--parallel N`, both servers run side by side on loopback ports with N slots (ours:
`q8rules serve --parallel N --threads T --ctx C`; llama-server: `-np N -t T -tb T -c N*C`, its
other settings its defaults), each idle while the other is measured. A measurement sends N
streamed text completions at once (distinct prompts, greedy, `max_tokens` 128 and `ignore_eos`,
so every stream decodes 128 tokens) and stamps each streamed event on arrival. Rounds are
interleaved (ours then theirs, then theirs then ours, ...), after one unmeasured warm-up
measurement a server; with N = 1 each round also runs `q8rules run` on the same prompt and
threads (its stderr's decode rate: tokens after the first chunk over their time).

  aggregate decode tokens/s  the events of all streams that arrive while every stream is
                             decoding (from the last stream's first event to the first stream's
                             last) over that time: the steady rate with N streams
  per stream                 each stream's events after its first over their time, the mean
  end to end                 all generated tokens (`usage`) over the time from the requests'
                             start to the last stream's end (prefill and HTTP included)

Before each measurement (and each `q8rules run`) the script waits, up to `--quiet-wait`
seconds, until no other task has wanted a CPU for 2 s (/proc/loadavg's runnable count, sampled
every 0.1 s): on a shared machine another job's threads take the cores from the servers' (and
llama-server's threads wait for each other at every op of its graph: it slows down far more
than ours under load). Medians and bests over the rounds; the load average is read before each
measurement, and a measurement that started without a quiet moment is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from q8rules.serve import free_port  # noqa: E402

PROMPTS = [
  "Once upon a time, in a small village by the mountains, there lived",
  "The history of the printing press begins",
  "Here is a long story about a cat who learned to sail:",
  "In the year 2150, the first city on Mars",
  "The recipe for a good bread starts with",
  "A letter to my younger self:",
  "The old lighthouse keeper looked at the sea and",
  "Chapter 1. The train left the station at dawn,",
]
TOKENS = 128
RUN_RATE = re.compile(r"decode: ([\d.]+) generated tokens/s")


@dataclasses.dataclass
class Stream:
  """One streamed completion: the arrival times of its events and its generated tokens."""

  stamps: list[float]
  tokens: int


@dataclasses.dataclass
class Measure:
  """One measurement of N streams."""

  aggregate: float
  per_stream: float
  end_to_end: float
  load: str
  quiet: bool
  events: int
  tokens: int


def act(args: argparse.Namespace) -> list[str]:
  """Our side's `--act-qtype` (Q8_0 activations: llama-server's own arithmetic), if asked."""
  return ["--act-qtype", args.act_qtype] if args.act_qtype else []


def serve_command(side: str, args: argparse.Namespace, model: str, port: int, n: int) -> list:
  """The command line of our server or llama-server with `n` slots."""
  t = str(args.threads)
  if side == "ours":
    return [sys.executable, "-m", "q8rules", "serve", model, "--port", str(port), "--parallel",
            str(n), "--threads", t, "--ctx", str(args.ctx), "--no-progress", *act(args)]  # fmt: skip
  return [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np",
          str(n), "-t", t, "-tb", t, "-c", str(n * args.ctx)]  # fmt: skip


def start(
  cmd: list, log: Path, url: str, timeout: float = 900.0, tree: Path | None = None
) -> subprocess.Popen:
  """`cmd` in a subprocess (output to `log`), once its /health answers 200; q8rules imported
  from this checkout, or from `tree` (then also its working directory)."""
  env = {**os.environ, "PYTHONPATH": str(tree or ROOT)}
  proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tree)
  deadline = time.monotonic() + timeout
  while True:
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      raise SystemExit(f"{cmd[0]} did not start (see {log})")
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return proc
    except httpx.HTTPError:
      pass
    time.sleep(0.5)


async def one(http: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> Stream:
  """One streamed greedy completion of `tokens` tokens."""
  body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
          "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
  stamps, used = [], None
  async with http.stream("POST", url + "/v1/completions", json=body) as r:
    r.raise_for_status()
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if "error" in event:
        raise RuntimeError(f"{url}: {event['error']}")
      if event.get("usage"):
        used = event["usage"]["completion_tokens"]
      if event.get("choices") and event["choices"][0].get("text"):
        stamps.append(time.perf_counter())
  return Stream(stamps, used if used is not None else len(stamps))


async def streams(url: str, n: int, tokens: int) -> tuple[list[Stream], float, float]:
  """`n` completions at once: the streams, the start and the end time."""
  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 2)) as http:
    begin = time.perf_counter()
    out = await asyncio.gather(
      *(one(http, url, PROMPTS[i % len(PROMPTS)], tokens) for i in range(n))
    )
    return list(out), begin, time.perf_counter()


def runnable() -> int:
  """The tasks running or waiting for a CPU now (/proc/loadavg's fourth field), this one
  included."""
  return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


def wait_quiet(limit: float) -> bool:
  """Waits until no other task has wanted a CPU for 2 s, or `limit` seconds; whether it was
  quiet."""
  deadline, calm = time.monotonic() + limit, 0
  while calm < 20:
    if time.monotonic() > deadline:
      return False
    calm = calm + 1 if runnable() <= 1 else 0
    time.sleep(0.1)
  return True


def measure(url: str, n: int, tokens: int, limit: float = 0.0) -> Measure:
  """The rates of `n` streams of `tokens` tokens against the server at `url`, after waiting up
  to `limit` seconds for a quiet machine."""
  quiet = wait_quiet(limit)
  load = load_average()
  out, begin, end = asyncio.run(streams(url, n, tokens))
  if any(len(s.stamps) < 2 for s in out):
    raise RuntimeError(f"{url}: a stream sent fewer than 2 events")
  t0 = max(s.stamps[0] for s in out)
  t1 = min(s.stamps[-1] for s in out)
  inside = sum(t0 <= x <= t1 for s in out for x in s.stamps)
  if t1 - t0 > 0.5 and inside > 2 * n:
    aggregate = (inside - n) / (t1 - t0)  # the events at t0 of the streams that start there
  else:  # streams too far apart to overlap: all decode time
    aggregate = sum(len(s.stamps) - 1 for s in out) / (max(s.stamps[-1] for s in out) - t0)
  per = statistics.mean((len(s.stamps) - 1) / (s.stamps[-1] - s.stamps[0]) for s in out)
  events, used = sum(len(s.stamps) for s in out), sum(s.tokens for s in out)
  if events < 0.95 * used:  # the rates count events: they must be tokens
    raise RuntimeError(f"{url}: {events} text events for {used} tokens")
  return Measure(aggregate, per, used / (end - begin), load, quiet, events, used)


def run_rate(args: argparse.Namespace, model: str) -> float:
  """`q8rules run`'s decode rate on PROMPTS[0], `TOKENS` tokens, the same threads."""
  cmd = [sys.executable, "-m", "q8rules", "run", model, "-p", PROMPTS[0], "-n", str(TOKENS),
         "--threads", str(args.threads), "--no-progress", *act(args)]  # fmt: skip
  proc = subprocess.run(
    cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
  )
  m = RUN_RATE.search(proc.stderr)
  if proc.returncode or m is None:
    raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr[-2000:]}")
  return float(m.group(1))


def llama_server_info(args: argparse.Namespace, model: str) -> tuple[str, str]:
  """llama-server's `--version`, and the system_info line it logs at start (at log verbosity 4:
  a short start of its own, ended once the line is out)."""
  v = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True)
  version = " ".join((v.stdout + v.stderr).split())
  cmd = [args.llama_server, "-m", model, "--port", str(free_port()), "-t", str(args.threads),
         "-c", str(args.ctx), "-lv", "4"]  # fmt: skip
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  info = "n/a"
  try:
    for line in proc.stdout:
      if "system_info" in line:
        info = line.split("system_info:", 1)[1].strip()
        break
  finally:
    proc.kill()
    proc.wait(60)
  return version, info


def code_version() -> str:
  """The checkout's commit, and whether its library (q8rules/) differs from it."""
  git = ["git", "-C", str(ROOT)]
  head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "q8rules"],
                         capture_output=True, text=True)  # fmt: skip
  if head.returncode:
    return "n/a (not a git checkout)"
  return head.stdout.strip() + (" with uncommitted edits" if dirty.stdout.strip() else " (clean)")


def fmt(xs: list[float]) -> str:
  return f"{statistics.median(xs):.1f} ({', '.join(f'{x:.0f}' for x in xs)})"


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("model", help="a Q8_0 GGUF file")
  p.add_argument("--llama-server", required=True, help="the llama-server binary")
  p.add_argument("--parallel", default="1,4,8", help="the slot counts, comma-separated")
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--ctx", type=int, default=256, help="positions per slot")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--quiet-wait", type=float, default=300.0,
                 help="the most seconds to wait for a quiet machine before a measurement")  # fmt: skip
  p.add_argument("--act-qtype", choices=["q8_0"], default=None,
                 help="our server and run with Q8_0 activations (llama-server's int8 dots)")  # fmt: skip
  p.add_argument("--write", action="store_true", help="write the section of RESULTS.md")
  p.add_argument("--section", default="serve-vs-llama-server",
                 help="RESULTS.md section (one per ISA: e.g. serve-vs-llama-server-avx2)")  # fmt: skip
  args = p.parse_args()
  model = str(Path(args.model).resolve())
  counts = [int(x) for x in args.parallel.split(",")]
  results: dict[tuple[str, int], list[Measure]] = {}
  run: list[float] = []
  info = llama_server_info(args, model)
  print(f"llama-server: {info[0]}; system_info: {info[1]}", flush=True)
  for n in counts:
    servers, logs = {}, {}
    try:
      for side in ("ours", "theirs"):
        port = free_port()
        logs[side] = Path("/tmp") / f"bench_vs_llama_server_{side}_{n}.log"
        url = f"http://127.0.0.1:{port}"
        servers[side] = (start(serve_command(side, args, model, port, n), logs[side], url), url)
        measure(url, n, 8)  # warm-up
      for r in range(args.rounds):
        order = ["ours", "theirs"] if r % 2 == 0 else ["theirs", "ours"]
        if n == 1:
          order += ["run"]
        for side in order:
          if side == "run":
            wait_quiet(args.quiet_wait)
            run.append(run_rate(args, model))
            print(f"  parallel 1 round {r}: q8rules run {run[-1]:.1f} tok/s", flush=True)
            continue
          m = measure(servers[side][1], n, TOKENS, args.quiet_wait)
          results.setdefault((side, n), []).append(m)
          print(f"  parallel {n} round {r}: {side:6s} aggregate {m.aggregate:6.1f}, per stream"
                f" {m.per_stream:6.1f}, end to end {m.end_to_end:6.1f} tok/s; load {m.load}"
                f"{'' if m.quiet else ' (not quiet)'}",
                flush=True)  # fmt: skip
    finally:
      for proc, _ in servers.values():
        proc.terminate()
        proc.wait(60)
  rows = []
  for n in counts:
    runs = fmt(run) if n == 1 and run else "-"
    ours, theirs = results[("ours", n)], results[("theirs", n)]
    a, b = ([m.aggregate for m in ms] for ms in (ours, theirs))
    target = "" if n == 1 else " (target >= 1.5)"
    rows.append(
      f"| {n} | {fmt(a)} | {fmt(b)} | **{statistics.median(a) / statistics.median(b):.2f}x**"
      f"{target} | {max(a) / max(b):.2f}x | {fmt([m.per_stream for m in ours])}"
      f" | {fmt([m.per_stream for m in theirs])} | {fmt([m.end_to_end for m in ours])}"
      f" | {fmt([m.end_to_end for m in theirs])} | {runs} |"
    )
  table = "\n".join(
    [
      "| streams (--parallel) | ours: aggregate decode tok/s, median (runs) | llama-server"
      " | ours / llama-server, medians | bests | ours: per stream | llama-server: per stream"
      " | ours: end to end | llama-server: end to end | `q8rules run` decode tok/s |",
      "|---|---|---|---|---|---|---|---|---|---|",
      *rows,
    ]
  )
  blocks = [table]
  if run:
    serve1 = [m.aggregate for m in results[("ours", 1)]]
    blocks.append(
      f"Single stream: `q8rules serve --parallel 1` {fmt(serve1)} tokens/s against `q8rules run`"
      f" {fmt(run)} on the same prompt and threads: medians"
      f" **{statistics.median(serve1) / statistics.median(run):.2f}x**, bests"
      f" {max(serve1) / max(run):.2f}x (target >= 0.95)."
    )
  noisy = sum(not m.quiet for ms in results.values() for m in ms)
  total = sum(len(ms) for ms in results.values())
  blocks.append(
    f"{total - noisy} of {total} server measurements started on a quiet machine (no other task"
    f" wanting a CPU for 2 s; `--quiet-wait {args.quiet_wait:g}`)."
  )
  loads = sorted({m.load for ms in results.values() for m in ms})
  blocks.append(f"Load averages before the measurements: {'; '.join(loads)}.")
  events = {side: sum(m.events for (s, _), ms in results.items() if s == side for m in ms)
            for side in ("ours", "theirs")}  # fmt: skip
  tokens = {side: sum(m.tokens for (s, _), ms in results.items() if s == side for m in ms)
            for side in ("ours", "theirs")}  # fmt: skip
  blocks.append(
    f"Streamed text events counted against the tokens `usage` reports: ours {events['ours']} /"
    f" {tokens['ours']}, llama-server {events['theirs']} / {tokens['theirs']}."
  )
  print("\n\n".join(blocks))
  if not args.write:
    return
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  header = (
    f"{when}. Machine: {machine()}; load average at the end {load_average()}. Model:"
    f" {Path(args.model).name}; {args.threads} threads each; {TOKENS} greedy tokens a stream"
    f" (`ignore_eos`); {args.ctx} positions a slot; medians of {args.rounds} interleaved rounds."
    f" Ours: {'act_qtype=' + args.act_qtype + ' (Q8_0 activations)' if args.act_qtype else 'weight-only (float32 activations)'}."
    f" Code: {code_version()}."
    f" llama-server: `{info[0]}`; system_info: `{info[1]}`."
  )
  command = "python benchmarks/bench_serve_vs_llama_server.py " + " ".join(sys.argv[1:])
  heading = "## q8rules serve against llama-server (`benchmarks/bench_serve_vs_llama_server.py`)"
  name = args.section
  write_section(name, section(name, heading, header, command, blocks))


if __name__ == "__main__":
  main()
