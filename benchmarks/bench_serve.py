"""`q8rules serve` under load: concurrent clients x requests of mixed lengths, streamed and not,
some cancelled mid-stream, against a server in a subprocess on a loopback port.

Every request is greedy; each distinct (prompt, max_tokens) is first run alone, and every
completed response under load must equal it (token for token in text). Reports failed requests,
server errors, p50 / p95 time to first token (streamed requests) and inter-token latency (the
gaps between streamed events), the server's RSS after request 100 and after the last, and the
aggregate decode rate; writes its section of benchmarks/RESULTS.md.

    python benchmarks/bench_serve.py MODEL.gguf [--clients 32 --requests 20 --parallel 4]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from q8rules.serve import free_port  # noqa: E402

PROMPTS = [
  "The capital of France is",
  "Write a short poem about the sea.",
  "List three colors:",
  "Once upon a time, in a small village by the mountains, there lived",
  "Explain what a transformer model is in one sentence.",
  "1, 2, 3, 4,",
  "The quick brown fox",
  "Q: What is 2 + 2?\nA:",
]
LENGTHS = [8, 24, 48]


def rss_kib(pid: int) -> int:
  """The resident set of process `pid`, KiB."""
  for line in Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1])
  return 0


def percentile(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def one(http: httpx.AsyncClient, url: str, prompt: str, n: int, stream: bool, cancel: bool):
  """One completion: (text, ttft s or None, inter-event gaps, status, finish reason)."""
  body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
  start = time.perf_counter()
  if not stream:
    r = await http.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
      return None, None, [], r.status_code, None
    choice = r.json()["choices"][0]
    return choice["text"], None, [], 200, choice["finish_reason"]
  text, stamps, finish = [], [], None
  async with http.stream("POST", url + "/v1/completions", json=body) as r:
    if r.status_code != 200:
      return None, None, [], r.status_code, None
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if "error" in event:
        return None, None, [], 500, None
      choice = event["choices"][0]
      if choice["text"]:
        stamps.append(time.perf_counter())
        text.append(choice["text"])
      finish = choice["finish_reason"] or finish
      if cancel and len(stamps) >= 3:
        break  # the client goes away mid-stream
  ttft = stamps[0] - start if stamps else None
  gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
  return "".join(text), ttft, gaps, 200, "cancelled" if cancel else finish


async def load(url: str, args: argparse.Namespace, pid: int, want: dict) -> dict:
  rng = random.Random(0)
  jobs = []
  for c in range(args.clients):
    for _ in range(args.requests):
      prompt, n = rng.choice(PROMPTS), rng.choice(LENGTHS)
      stream = rng.random() < 0.6
      jobs.append((c, prompt, n, stream, stream and rng.random() < 0.1))
  done, rss, out = 0, {}, {"ttft": [], "gaps": [], "failed": 0, "mismatch": 0, "cancelled": 0}
  limits = httpx.Limits(max_connections=args.clients + 4)
  async with httpx.AsyncClient(timeout=300, limits=limits) as http:

    async def client(c: int) -> None:
      nonlocal done
      for _, prompt, n, stream, cancel in [j for j in jobs if j[0] == c]:
        text, ttft, gaps, status, finish = await one(http, url, prompt, n, stream, cancel)
        done += 1
        if done in (100, len(jobs)):
          rss[done] = rss_kib(pid)
        if status != 200:
          out["failed"] += 1
          continue
        if ttft is not None:
          out["ttft"].append(ttft)
        out["gaps"].extend(gaps)
        if cancel:
          out["cancelled"] += 1
        elif text != want[(prompt, n)]:
          out["mismatch"] += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(args.clients)))
    out["seconds"] = time.perf_counter() - start
    metrics = (await http.get(url + "/metrics")).text
  out["rss"], out["requests"] = rss, len(jobs)
  out["generated"] = next(
    float(line.split()[-1])
    for line in metrics.splitlines()
    if line.startswith("q8rules_generation_tokens_total")
  )
  return out


async def alone(url: str) -> dict:
  """Each distinct (prompt, max_tokens), run alone, greedy: its text."""
  want = {}
  async with httpx.AsyncClient(timeout=300) as http:
    for prompt in PROMPTS:
      for n in LENGTHS:
        text, _, _, status, _ = await one(http, url, prompt, n, False, False)
        assert status == 200, status
        want[(prompt, n)] = text
  return want


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("model")
  p.add_argument("--clients", type=int, default=32)
  p.add_argument("--requests", type=int, default=20, help="per client")
  p.add_argument("--parallel", type=int, default=4)
  p.add_argument("--ctx", type=int, default=256)
  p.add_argument("--threads", type=int, default=None)
  p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
  args = p.parse_args()
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "q8rules", "serve", args.model, "--port", str(port),
         "--parallel", str(args.parallel), "--ctx", str(args.ctx), "--no-progress"]  # fmt: skip
  if args.threads:
    cmd += ["--threads", str(args.threads)]
  log = open(Path("/tmp") / f"bench_serve_{port}.log", "w")  # noqa: SIM115
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 600
    while True:
      if proc.poll() is not None or time.monotonic() > deadline:
        raise SystemExit(f"the server did not start (see {log.name})")
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        time.sleep(0.5)
    want = asyncio.run(alone(url))
    out = asyncio.run(load(url, args, proc.pid, want))
  finally:
    proc.terminate()
    proc.wait(60)
  ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
  rss100, rss_end = out["rss"].get(100, 0), out["rss"].get(out["requests"], 0)
  rows = [
    ("requests", f"{out['requests']} ({args.clients} clients x {args.requests})"),
    ("failed requests / server errors", str(out["failed"])),
    ("greedy responses unlike the same request alone", str(out["mismatch"])),
    ("cancelled mid-stream", str(out["cancelled"])),
    ("time to first token p50 / p95 (ms)",
     f"{ms(statistics.median(out['ttft']))} / {ms(percentile(out['ttft'], 0.95))}"),
    ("inter-token latency p50 / p95 (ms)",
     f"{ms(statistics.median(out['gaps']))} / {ms(percentile(out['gaps'], 0.95))}"),
    (f"server RSS at request 100 / {out['requests']} (MiB)",
     f"{rss100 / 1024:.0f} / {rss_end / 1024:.0f} ({100 * (rss_end / max(rss100, 1) - 1):+.1f} %)"),
    ("generated tokens, wall time, aggregate tokens/s",
     f"{out['generated']:.0f}, {out['seconds']:.1f} s, {out['generated'] / out['seconds']:.1f}"),
  ]  # fmt: skip
  table = "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
  print(table)
  if args.no_write:
    return
  when = datetime.date.today().isoformat()
  header = (
    f"{when}. Machine: {machine()}; load average {load_average()}. Model: {Path(args.model).name},"
    f" --parallel {args.parallel}, --ctx {args.ctx}; greedy; 60 % streamed, 10 % of those"
    " cancelled after 3 events."
  )
  command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])
  heading = "## q8rules serve under load (`benchmarks/bench_serve.py`)"
  write_section("serve", section("serve", heading, header, command, [table]))


if __name__ == "__main__":
  main()
