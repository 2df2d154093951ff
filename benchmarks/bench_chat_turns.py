"""A multi-turn chat against `q8rules serve` and llama-server (its prompt cache on): the time to
first token of each turn, as the history grows.

    python benchmarks/bench_chat_turns.py MODEL.gguf --llama-server /path/to/llama-server \\
        [--turns 10 --turn-words 65 --reply-tokens 32 --threads 2 --ctx 4096 --write]

Each server runs alone on a loopback port with one slot (ours: `q8rules serve --parallel 1
--threads T --ctx C`; llama-server: `-np 1 -t T -tb T -c C`, whose `cache_prompt` is on by
default). The chat is the same for both: turn i adds a user message of `--turn-words` made-up
words (fixed seed: about 150 tokens on SmolLM2's vocabulary), the reply is greedy and at most
`--reply-tokens` tokens, and the next turn sends the whole history with each server's own
replies. A turn's time to first token is from sending the request to the first streamed event
with text; its prompt tokens are the server's `usage.prompt_tokens`. Turn 1 pays for the
system prompt and the first message; a server that reuses the cached prefix pays only for the
new tokens on later turns, one that does not pays for the whole history again.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_serve_vs_llama_server import code_version, start  # noqa: E402
from benchmarks.results_md import publish  # noqa: E402
from benchmarks.sse import events  # noqa: E402
from q8rules.serve import free_port  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly."


def made_up_words(n: int, rng: np.random.Generator) -> str:
  """`n` pronounceable made-up words (no repeats of real text, so nothing is memorised)."""
  cons, vows = "bcdfghklmnprstvz", "aeiou"
  words = []
  for _ in range(n):
    k = int(rng.integers(1, 4))
    words.append("".join(rng.choice(list(cons)) + rng.choice(list(vows)) for _ in range(k)))
  return " ".join(words)


def turn(http: httpx.Client, url: str, messages: list[dict], tokens: int) -> tuple[float, str, int]:
  """One streamed greedy chat turn: (time to first text, the reply, the prompt's tokens)."""
  body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}  # fmt: skip
  begin, first, reply, prompt = time.perf_counter(), None, [], -1
  with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
    r.raise_for_status()
    for event in events(r.iter_lines()):
      if event.get("usage"):
        prompt = event["usage"]["prompt_tokens"]
      for choice in event.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
          first = first or time.perf_counter()
          reply.append(text)
  return (first or time.perf_counter()) - begin, "".join(reply), prompt


def chat(url: str, args: argparse.Namespace) -> list[tuple[int, float]]:
  """The whole chat on one server: (prompt tokens, time to first token) per turn."""
  rng = np.random.default_rng(0)
  messages = [{"role": "system", "content": SYSTEM}]
  out = []
  with httpx.Client(timeout=900) as http:
    for _ in range(args.turns):
      messages.append({"role": "user", "content": made_up_words(args.turn_words, rng)})
      ttft, reply, prompt = turn(http, url, messages, args.reply_tokens)
      messages.append({"role": "assistant", "content": reply})
      out.append((prompt, ttft))
      print(
        f"{url}: turn {len(out)}: {prompt} prompt tokens, first token after {ttft:.2f} s",
        file=sys.stderr,
      )
  return out


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("model")
  p.add_argument("--llama-server", required=True)
  p.add_argument("--turns", type=int, default=10)
  p.add_argument("--turn-words", type=int, default=65)
  p.add_argument("--reply-tokens", type=int, default=32)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--ctx", type=int, default=4096)
  p.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
  args = p.parse_args()
  t = str(args.threads)
  results = {}
  with tempfile.TemporaryDirectory(prefix="chat-turns-") as tmp:
    for side in ("q8rules serve", "llama-server"):
      port = free_port()
      if side == "q8rules serve":
        cmd = [sys.executable, "-m", "q8rules", "serve", args.model, "--port", str(port), "--parallel", "1",
               "--threads", t, "--ctx", str(args.ctx), "--no-progress"]  # fmt: skip
      else:
        cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
               "-t", t, "-tb", t, "-c", str(args.ctx)]  # fmt: skip
      url = f"http://127.0.0.1:{port}"
      proc = start(cmd, Path(tmp) / f"{side.split()[0]}.log", url)
      try:
        turn(httpx.Client(timeout=900), url, [{"role": "user", "content": "Hi"}], 4)  # warm-up
        results[side] = chat(url, args)
      finally:
        proc.terminate()
        proc.wait(30)
  ours, theirs = results["q8rules serve"], results["llama-server"]
  rows = ["| turn | prompt tokens (ours / llama-server) | TTFT ours (s) | TTFT llama-server (s) | ours / llama-server |",
          "|---:|---:|---:|---:|---:|"]  # fmt: skip
  for i, ((pa, ta), (pb, tb)) in enumerate(zip(ours, theirs, strict=True), 1):
    rows.append(f"| {i} | {pa} / {pb} | {ta:.2f} | {tb:.2f} | {ta / tb:.2f}x |")
  rows.append(
    f"\nTurn {args.turns} against turn 1: ours {ours[-1][1] / ours[0][1]:.2f}x, "
    f"llama-server {theirs[-1][1] / theirs[0][1]:.2f}x."
  )
  header = (
    f"Model: {Path(args.model).name}; {args.turns} turns of {args.turn_words} made-up words,"
    f" replies of at most {args.reply_tokens} tokens, {args.threads} threads. Code: {code_version()}."
  )
  heading = "## A multi-turn chat: time to first token as the history grows (`benchmarks/bench_chat_turns.py`)"
  publish("chat-turns", heading, header, ["\n".join(rows)], args.write)


if __name__ == "__main__":
  main()
