"""One decode product (m = 1) of the native CPU kernel at 1 and 2 threads, at the shapes of the
decode benchmark's models, weights read from DRAM: how the kernel's thread split scales.

    python benchmarks/bench_threads.py [--threads 1,2] [--write]

Per shape: enough weight copies (distinct random Q8_0 values) to total >= 256 MB, stacked
(L, K, N), so that each product reads its weight from DRAM; one jitted `lax.fori_loop` runs
the product on every copy in turn through the kernel's in-place layer target (as a decoder's
scanned layers call it), each product's input depending on the last one's output, so the
time per product has no Python dispatch in it (an earlier version of this script called a
jitted product once per copy from Python: at the 576-wide shapes that dispatch was most of
the time). The time is the best of 5 loops' mean per product. GB/s: the Q8_0 weight's bytes
(K * N * 34 / 32) over that time, and that as a fraction of `bandwidth.py`'s read bandwidth
at the same threads. The thread limit is `q8rules.set_cpu_threads`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bandwidth import read_bandwidth  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

SHAPES = {
  "SmolLM-135M q, o": (576, 576),
  "SmolLM-135M q+k+v": (576, 960),
  "SmolLM-135M down": (1536, 576),
  "SmolLM-135M gate+up": (576, 3072),
  "TinyLlama-1.1B q, o": (2048, 2048),
  "TinyLlama-1.1B down": (5632, 2048),
  "TinyLlama-1.1B gate+up": (2048, 11264),
}
"""name -> (K, N) of the decode benchmark's products (fused as `load_gguf` fuses them)."""

ROTATE_BYTES = 256 << 20


def time_product(k: int, n: int, threads: int) -> float:
  """Seconds a product: the best of 5 loops over the copies."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import q8rules
  from q8rules.kernels.matmul.cpu import q8_matmul_cpu_layer

  q8rules.set_cpu_threads(threads)
  rng = np.random.default_rng(k * n)
  copies = max(3, -(-ROTATE_BYTES // (k * n * 34 // 32)))
  q = jnp.asarray(rng.integers(-127, 128, (copies, k, n), dtype=np.int8))
  scale = jnp.asarray(rng.random((copies, k // 32, n)).astype(np.float16) / 64)
  x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)

  @jax.jit
  def loop(x, q, scale):
    def body(i, x):  # the next x depends on this product: one after another, as in decode
      y = q8_matmul_cpu_layer(x, q, scale, i)
      return x + 1e-30 * y[:, :1]

    return jax.lax.fori_loop(0, copies, body, x)

  loop(x, q, scale).block_until_ready()
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    loop(x, q, scale).block_until_ready()
    best = min(best, (time.perf_counter() - t) / copies)
  q8rules.set_cpu_threads(None)
  return best


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--threads", default="1,2")
  ap.add_argument("--write", action="store_true", help="write RESULTS.md's `threads` section")
  args = ap.parse_args()
  threads = [int(t) for t in args.threads.split(",")]
  probe = {t: read_bandwidth(t, gib=2.0) for t in threads}
  head = "| product | K | N | " + " | ".join(
    f"{t} thread{'s' * (t > 1)} us (GB/s, of the read bandwidth)" for t in threads
  )
  head += f" | {threads[-1]} / {threads[0]} threads |" if len(threads) > 1 else " |"
  lines = [head, "|---|---:|---:|" + "---:|" * (len(threads) + (len(threads) > 1))]
  for name, (k, n) in SHAPES.items():
    times = {t: time_product(k, n, t) for t in threads}
    cells = []
    for t in threads:
      gbs = k * n * 34 / 32 / times[t] / 1e9
      cells.append(f"{times[t] * 1e6:.0f} ({gbs:.1f}, {gbs / probe[t]:.0%})")
    speedup = [f"{times[threads[0]] / times[threads[-1]]:.2f}x"] if len(threads) > 1 else []
    lines.append(f"| {name} | {k} | {n} | " + " | ".join(cells + speedup) + " |")
    print(lines[-1], flush=True)
  heading = "## One decode product at 1 and 2 threads (native CPU kernel, from DRAM)"
  report("threads", heading, "bench_threads.py", probe, lines, args.write)


def report(
  name: str, heading: str, script: str, probe: dict[int, float], lines: list[str], write: bool
) -> None:
  """Print the table `lines` under the probe's figures; with `write`, as RESULTS.md's section
  `name` (the date, the machine, the load average and the probe in its header)."""
  probe_text = ", ".join(f"{t} thread{'s' * (t > 1)} {gbs:.1f} GB/s" for t, gbs in probe.items())
  table = "\n".join(lines)
  print(f"read bandwidth: {probe_text}\n{table}")
  if write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
      f"{when}. Machine: {machine()}. Load average at the end: {load_average()}. Read"
      f" bandwidth (`benchmarks/bandwidth.py`, 2 GiB): {probe_text}."
    )
    cmd = f"python benchmarks/{script} --write"
    write_section(name, section(name, heading, header, cmd, [table]))


if __name__ == "__main__":
  main()
