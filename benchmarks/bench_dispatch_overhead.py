"""Median time of `q8_matmul(x, w, implementation=...)` at K = N = 4096, m = 1, float32.

    python benchmarks/bench_dispatch_overhead.py xla,cpu

Run it from two trees alternately (e.g. a `git worktree` of an older commit, with
`PYTHONPATH` pointing there) to see whether a change to the dispatch path costs time. It
prints which q8rules it imported. 12 weight copies are rotated; median of 60 calls.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import q8rules


def main(impls: list[str]) -> None:
  rng = np.random.default_rng(0)
  k = n = 4096
  weights = [
    q8rules.quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))) for _ in range(12)
  ]
  x = jnp.asarray(rng.standard_normal((1, k)).astype(np.float32))
  for impl in impls:
    f = jax.jit(lambda x, w, impl=impl: q8rules.q8_matmul(x, w, implementation=impl))
    for w in weights:
      f(x, w).block_until_ready()
    times = []
    for _ in range(5):
      for w in weights:
        t = time.perf_counter()
        f(x, w).block_until_ready()
        times.append(time.perf_counter() - t)
    print(f"{impl}: {statistics.median(times) * 1e3:.3f} ms  ({q8rules.__file__})")


if __name__ == "__main__":
  main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["xla", "cpu"])
