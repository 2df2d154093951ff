"""Median time of `q8_matmul(x, w, implementation=...)` at K = N = 4096, m = 1, float32.

    python benchmarks/bench_dispatch_overhead.py xla,cpu

Run it from two trees alternately (e.g. a `git worktree` of an older commit, with
`PYTHONPATH` pointing there) to see whether a change to the dispatch path costs time. It
prints which q8rules it imported; the timer (`q8rules/timing.py`) and the shapes are this
script's tree's, whichever q8rules is measured. 12 weight copies (Llama-3-8B's q projection,
`benchmarks/shapes.py`) are rotated; median of 60 calls.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import q8rules  # the tree under test: PYTHONPATH's, else the installed one

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.shapes import LLAMA3_8B  # noqa: E402

COPIES = 12


def own_timing():
  """This tree's q8rules/timing.py, loaded by path (stdlib and jax only): the q8rules under
  test may be an older tree without it."""
  spec = importlib.util.spec_from_file_location("q8rules_timing", ROOT / "q8rules" / "timing.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main(impls: list[str]) -> None:
  median_time = own_timing().median_time
  rng = np.random.default_rng(0)
  k, n = LLAMA3_8B.shape("q")
  weights = [
    q8rules.quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)))
    for _ in range(COPIES)
  ]
  x = jnp.asarray(rng.standard_normal((1, k)).astype(np.float32))
  for impl in impls:
    f = jax.jit(lambda x, w, impl=impl: q8rules.q8_matmul(x, w, implementation=impl))
    seconds = median_time(f, x, warmup=COPIES, reps=5 * COPIES, rotate=weights)
    print(f"{impl}: {seconds * 1e3:.3f} ms  ({q8rules.__file__})")


if __name__ == "__main__":
  main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["xla", "cpu"])
