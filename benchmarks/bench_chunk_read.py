"""A served prompt chunk at a position of a long cache row: the chunk reading the shortest start
of the row that holds what it sees (`q8rules.models.attention.read_lengths`) against reading the
whole row, and against the same chunk in a row as short as `q8rules run` makes.

    python benchmarks/bench_chunk_read.py MODEL.gguf [--ctx 8192 --short 1024 --repeats 3 --write]

One `BatchRunner` slot, as `q8rules serve` prefills (one row, chunks of `CHUNK` = 128 tokens),
each timed as `BatchRunner.prefill` of a chunk before the last (the chunk program alone), the
median of `--repeats` after one warm-up run. "whole" patches `read_lengths` to the row's length alone: what every chunk read before. The rate is the
chunk's tokens over its time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import q8rules  # noqa: E402
from benchmarks.results_md import publish  # noqa: E402
from q8rules.engine.runner import CHUNK, BatchRunner  # noqa: E402
from q8rules.engine.sampling import RowSettings  # noqa: E402
from q8rules.models import attention  # noqa: E402


def chunk_seconds(model, ctx: int, positions: list[int], repeats: int) -> dict[int, float]:
  """The median seconds of one CHUNK-token prefill program at each position of a `ctx` row."""
  runner = BatchRunner(model, 1, ctx)
  tokens = np.arange(1000, 1000 + CHUNK, dtype=np.int32)
  key, history, settings = np.zeros(2, np.uint32), np.full(64, -1, np.int32), RowSettings.empty(1)

  def run(pos: int) -> float:
    start = time.perf_counter()
    runner.prefill(0, tokens, pos, key, history, settings, last=False)  # the chunk program alone
    jax.block_until_ready(runner.cache)
    return time.perf_counter() - start

  run(0)
  return {p: statistics.median(run(p) for _ in range(repeats)) for p in positions}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("model", type=Path)
  p.add_argument("--ctx", type=int, default=8192)
  p.add_argument("--short", type=int, default=1024)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--write", action="store_true", help="record the table in RESULTS.md")
  args = p.parse_args(argv)
  model = q8rules.load_gguf(args.model, progress=False)
  positions = [0, 512, 1024 + 256, args.ctx // 2 - CHUNK, args.ctx - CHUNK]
  fitted = chunk_seconds(model, args.ctx, positions, args.repeats)
  short = chunk_seconds(model, args.short, [0, args.short - CHUNK], args.repeats)
  lengths = attention.read_lengths
  attention.read_lengths = lambda s: (s,)
  try:
    whole = chunk_seconds(model, args.ctx, positions, args.repeats)
  finally:
    attention.read_lengths = lengths
  rows = [
    "| row | position | keys read | time (s) | tokens/s | whole row (s) | speed-up |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for pos in positions:
    read = next(n for n in lengths(args.ctx) if n >= pos + CHUNK)
    rows.append(
      f"| {args.ctx} | {pos} | {read} | {fitted[pos]:.3f} | {CHUNK / fitted[pos]:.0f} |"
      f" {whole[pos]:.3f} | {whole[pos] / fitted[pos]:.2f}x |"
    )
  for pos, sec in short.items():
    rows.append(f"| {args.short} | {pos} | {args.short} | {sec:.3f} | {CHUNK / sec:.0f} | - | - |")
  publish(
    "chunk_read",
    "## A prompt chunk's read of a long cache row (benchmarks/bench_chunk_read.py)",
    f"Model: {args.model.name}; one slot, chunks of {CHUNK} tokens; median of {args.repeats}.",
    ["\n".join(rows)],
    args.write,
  )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
