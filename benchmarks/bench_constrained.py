"""Decode with a structured-output constraint against decode without one, through
`q8rules serve`: tokens per second after the first token, one request at a time and beside a
free request.

    python benchmarks/bench_constrained.py MODEL.gguf [--tokens 96 --repeats 3 --threads 2 --write]

One `q8rules serve --parallel 2` on a loopback port. Each case is a streamed greedy chat
completion of `--tokens` tokens (the constrained ones: a JSON array of at least that many
strings, so the grammar never ends first; the free ones: `ignore_eos`), timed from its first
to its last token event; the rate is the tokens after the first over that time, the median of
`--repeats`. "beside" runs a constrained and a free request together (both slots decoding).
The ratio is a constrained rate over the free rate alone: the issue's target is >= 0.8.

Why it can be lower: a constrained row's next mask needs its last token, so while it decodes
each device program runs one step (a free batch runs up to `STEPS`), and the mask is computed
on the host (llguidance) between steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_serve_vs_llama_server import code_version, start  # noqa: E402
from benchmarks.results_md import publish  # noqa: E402
from benchmarks.sse import events  # noqa: E402
from q8rules.serve import free_port  # noqa: E402

MESSAGES = [{"role": "user", "content": "List many fruit names as a JSON array of strings."}]


def schema(n: int) -> dict:
  return {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": n}


def rate(url: str, tokens: int, constrained: bool) -> float:
  """Tokens per second after the first token of one streamed request."""
  body = {"messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}  # fmt: skip
  if constrained:
    body["response_format"] = {
      "type": "json_schema", "json_schema": {"name": "fruits", "schema": schema(tokens)}
    }  # fmt: skip
  else:
    body["ignore_eos"] = True
  stamps, used = [], None
  with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
    r.raise_for_status()
    for event in events(r.iter_lines()):
      if event.get("usage"):
        used = event["usage"]["completion_tokens"]
      if event.get("choices") and event["choices"][0]["delta"].get("content"):
        stamps.append(time.perf_counter())
  if used is None or used < tokens or len(stamps) < 2:
    raise SystemExit(f"a request ended early ({used} of {tokens} tokens)")
  return (used - 1) / (stamps[-1] - stamps[0])


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("model", type=Path)
  p.add_argument("--tokens", type=int, default=96)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--write", action="store_true", help="record the table in RESULTS.md")
  args = p.parse_args(argv)
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "q8rules", "serve", str(args.model), "--port", str(port),
         "--parallel", "2", "--ctx", "1024", "--threads", str(args.threads), "--no-progress"]  # fmt: skip
  with tempfile.TemporaryDirectory() as tmp:
    proc = start(cmd, Path(tmp) / "serve.log", url)
    try:
      rate(url, 8, False), rate(url, 8, True)  # warm: the first requests compile nothing more
      cases: dict[str, list[float]] = {"free": [], "constrained": [], "constrained beside free": []}
      for _ in range(args.repeats):
        cases["free"].append(rate(url, args.tokens, False))
        cases["constrained"].append(rate(url, args.tokens, True))
        side = threading.Thread(target=rate, args=(url, args.tokens * 2, False))
        side.start()
        time.sleep(0.5)  # the free request decoding first
        cases["constrained beside free"].append(rate(url, args.tokens, True))
        side.join()
    finally:
      proc.terminate()
      proc.wait(60)
  free = statistics.median(cases["free"])
  rows = ["| case | tokens/s after the first (median) | of free alone |", "| --- | --- | --- |"]
  for name, values in cases.items():
    mid = statistics.median(values)
    rows.append(f"| {name} | {mid:.1f} | {mid / free:.2f}x |")
  publish(
    "constrained",
    "## Constrained decode against free decode (`benchmarks/bench_constrained.py`)",
    f"{args.model.name}, {args.tokens} tokens, greedy, --threads {args.threads}, median of"
    f" {args.repeats}; code {code_version()}.",
    ["\n".join(rows)],
    args.write,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
