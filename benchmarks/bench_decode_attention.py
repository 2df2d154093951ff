"""One new token's attention on the CPU (op 'decode_attention'): the native kernel ('cpu')
against XLA's softmax attention ('xla', the op's plain-JAX reference: the decoder's own form),
with gpt-oss-20b's heads (64 query heads over 8 KV heads of 64, a sink logit per head) and
without sinks, over a float32 cache of 4096 positions and 2 layers, at several positions.

    python benchmarks/bench_decode_attention.py [--reps 50] [--write]

Each cell is the median of `reps` calls of the compiled function (block_until_ready each),
threads as the library and XLA pick them (2 cores here). A sliding-window layer of gpt-oss reads
a ring of 128 positions: the 128-position rows are that (XLA's form reads the whole cache
whatever the position; the kernel reads the positions written).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.results_md import load_average, machine, markers, write_section  # noqa: E402
from q8rules.kernels.decode_attention import api  # noqa: E402

HEADS, KV, D, LENGTH, LAYERS = 64, 8, 64, 4096, 2


def time_us(fn, args, reps: int) -> float:
  """Median µs of `reps` calls of jitted `fn` (after one that compiles)."""
  jax.block_until_ready(fn(*args))
  runs = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    runs.append(time.perf_counter() - t)
  return statistics.median(runs) * 1e6


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=50)
  ap.add_argument("--write", action="store_true", help="write the table to benchmarks/RESULTS.md")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows = [
    "| sinks | rows | positions | xla µs | kernel µs | xla / kernel |",
    "|---|---|---|---|---|---|",
  ]
  for batch in (1, 4):
    shape = (LAYERS, batch, LENGTH, KV, D)
    keys = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    values = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch, 1, HEADS, D)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(HEADS), jnp.float32)
    for with_sinks in (True, False):
      for pos in (127, 1023, 4095):
        at = jnp.full((batch,), pos, jnp.int32)
        cell = {}
        for impl in ("xla", "cpu"):
          fn = jax.jit(
            functools.partial(api.one_token, scale=D**-0.5, softcap=None, implementation=impl),
          )
          s = sinks if with_sinks else None
          cell[impl] = time_us(
            lambda q, k, v, p, fn=fn, s=s: fn(q, k, v, 1, p, sinks=s),
            (q, keys, values, at),
            args.reps,
          )
        rows.append(
          f"| {'yes' if with_sinks else 'no'} | {batch} | {pos + 1} | {cell['xla']:.0f} |"
          f" {cell['cpu']:.0f} | {cell['xla'] / cell['cpu']:.1f}x |"
        )
        print(rows[-1], flush=True)
  print("\n".join(rows))
  if args.write:
    start, end = markers("decode-attention")
    text = [
      start,
      "## One new token's attention: the native kernel against XLA's (CPU)",
      "",
      f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {machine()}",
      f"- load average at the end: {load_average()}",
      f"- command: `python benchmarks/bench_decode_attention.py {' '.join(sys.argv[1:])}`",
      "",
      __doc__.split("\n\n", 2)[2].strip(),
      "",
      *rows,
      end,
    ]
    write_section("decode-attention", "\n".join(text))


if __name__ == "__main__":
  main()
