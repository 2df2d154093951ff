"""CPU timings of the XLA Q8_0 path against dense and Qwix int8 products.

    python benchmarks/bench_cpu.py            # full run (a few minutes on 2 cores)
    python benchmarks/bench_cpu.py --quick    # K = N = 4096 only, fewer calls
    python benchmarks/bench_cpu.py --no-write # print the table, leave RESULTS.md alone

For K = N in {4096, 8192}, m in {1, 8, 64} rows and float32 / bfloat16
activations x (m, K), times `y = x @ W` four ways:

  dense f32    `jnp.dot` with a float32 weight (x cast to float32)
  dense bf16   `jnp.dot` with a bfloat16 weight (x cast to bfloat16), float32 out
  Qwix int8    Qwix's own weight-only int8 path with 32-row tiles:
               `qwix.quantize(w, int8, channelwise_axes=(1,), tiled_axes={0: 32})`
               (what `QuantizationRule(weight_qtype=int8, tile_size=32)` gives a
               Dense kernel) and `qwix.dot_general`
  q8 xla       `q8rules.q8_matmul(x, w, implementation="xla")`, a Q8_0 weight
               with float16 scales as GGUF stores it (8.5 bits per weight)

Each timing is the least of a few medians (rounds interleaved across the
paths, so a burst of load from other processes hits one round rather than one
path) of calls that rotate through enough copies of the weight (more than 3x
the L3 cache) that every call reads its weight from DRAM; each call is waited
for (`block_until_ready`). "Bytes" is what the call must move at least: the
weight as that path stores it, plus x and y. GB/s is bytes / time, and "% BW"
compares it with the machine's read bandwidth measured in the same run (the
better of a jitted sum and max over a 1 GiB float32 array).

Writes the table, with the date, machine and command, into
benchmarks/RESULTS.md between `<!-- cpu:start -->` and `<!-- cpu:end -->`
under `## CPU (XLA path)`, replacing only that section.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qwix  # noqa: E402

import q8rules  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
START, END = "<!-- cpu:start -->", "<!-- cpu:end -->"
HEADING = "## CPU (XLA path)"
L3_BYTES = 32 << 20
ROTATE_BYTES = 3 * L3_BYTES  # weights cycled through per timing: well past the L3
PATHS = ("dense f32", "dense bf16", "Qwix int8", "q8 xla")


def machine() -> str:
  """`lscpu`'s model name, the core count and the OS."""
  model = platform.processor() or "unknown CPU"
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"^Model name:\s*(.+)$", out, re.M)
    model = found.group(1).strip() if found else model
  except (OSError, subprocess.CalledProcessError):
    pass
  return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def load_average() -> str:
  try:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())
  except OSError:
    return "n/a"


def median_ms(fn: Callable, x: jax.Array, weights: list, calls: int) -> float:
  """Median milliseconds of `calls` calls `fn(x, w)` rotating through `weights`, each waited for."""
  times = []
  for i in range(max(calls, len(weights))):
    w = weights[i % len(weights)]
    start = time.perf_counter()
    jax.block_until_ready(fn(x, w))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def time_paths(x: jax.Array, weights: dict[str, list], calls: int, rounds: int) -> dict[str, float]:
  """Each path's time: the least of `rounds` medians, the rounds interleaved across paths so a
  burst of load from other processes on the machine hits one round, not one path."""
  for path in PATHS:  # compile, and fault every copy in
    for w in weights[path]:
      jax.block_until_ready(FUNCTIONS[path](x, w))
  best = {path: float("inf") for path in PATHS}
  for _ in range(rounds):
    for path in PATHS:
      best[path] = min(best[path], median_ms(FUNCTIONS[path], x, weights[path], calls))
  return best


def read_bandwidth(calls: int = 7) -> float:
  """GB/s of reading a 1 GiB float32 array: the better of a jitted sum and max (median of
  `calls` each)."""
  a = jnp.ones((1 << 28,), jnp.float32)
  best = 0.0
  for reduce in (jnp.sum, jnp.max):
    fn = jax.jit(reduce)
    jax.block_until_ready(fn(a))
    times = []
    for _ in range(calls):
      start = time.perf_counter()
      jax.block_until_ready(fn(a))
      times.append(time.perf_counter() - start)
    best = max(best, (1 << 30) / float(np.median(times)) / 1e9)
  del a
  return best


def nbytes(tree) -> int:
  return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def copies_for(weight_bytes: int) -> int:
  return max(2, -(-ROTATE_BYTES // weight_bytes))


def make_weights(k: int, n: int, seed: int) -> dict[str, list]:
  """Each path's weight copies (distinct values so no call hits the last one's cache)."""
  base = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.02
  q8_bytes = k * n + (k // 32) * n * 2
  out: dict[str, list] = {}
  count = copies_for(4 * k * n)
  out["dense f32"] = [base * (1 + 0.01 * i) for i in range(count)]
  count = copies_for(2 * k * n)
  out["dense bf16"] = [(base * (1 + 0.01 * i)).astype(jnp.bfloat16) for i in range(count)]
  count = copies_for(q8_bytes)
  out["Qwix int8"] = [
    qwix.quantize(base * (1 + 0.01 * i), jnp.int8, channelwise_axes=(1,), tiled_axes={0: 32})
    for i in range(count)
  ]
  out["q8 xla"] = [
    q8rules.quantize(base * (1 + 0.01 * i), scale_dtype=jnp.float16) for i in range(count)
  ]
  jax.block_until_ready(out)
  return out


DIMS = (((1,), (0,)), ((), ()))
FUNCTIONS: dict[str, Callable] = {
  "dense f32": jax.jit(lambda x, w: jnp.dot(x.astype(jnp.float32), w)),
  "dense bf16": jax.jit(
    lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
  ),
  "Qwix int8": jax.jit(lambda x, w: qwix.dot_general(x, w, DIMS)),
  "q8 xla": jax.jit(lambda x, w: q8rules.q8_matmul(x, w, implementation="xla")),
}


def run(sizes: list[int], rows: list[int], calls: int, rounds: int) -> tuple[list[dict], float]:
  bandwidth = read_bandwidth()
  print(f"read bandwidth: {bandwidth:.1f} GB/s", flush=True)
  records = []
  for k in sizes:
    weights = make_weights(k, k, seed=k)
    for m in rows:
      for act in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(act)
        row: dict[str, dict] = {}
        times = time_paths(x, weights, calls, rounds)
        for path in PATHS:
          ms = times[path]
          y = FUNCTIONS[path](x, weights[path][0])
          moved = nbytes(weights[path][0]) + nbytes(x) + nbytes(y)
          row[path] = dict(ms=ms, bytes=moved)
        for path in PATHS:
          r = row[path]
          gbs = r["bytes"] / (r["ms"] * 1e-3) / 1e9
          records.append(
            dict(
              k=k,
              m=m,
              act=jnp.dtype(act).name,
              path=path,
              ms=r["ms"],
              mb=r["bytes"] / 1e6,
              gbs=gbs,
              bw=gbs / bandwidth,
              vs_bf16=row["dense bf16"]["ms"] / r["ms"],
              vs_qwix=row["Qwix int8"]["ms"] / r["ms"],
            )
          )
          print(
            f"K=N={k} m={m} {jnp.dtype(act).name:8s} {path:10s} {r['ms']:8.3f} ms {gbs:6.1f} GB/s",
            flush=True,
          )
    del weights
  return records, bandwidth


def table(records: list[dict]) -> str:
  lines = [
    "| K = N | m | x | path | median ms | MB moved | GB/s | % read BW | speed vs dense bf16 | speed vs Qwix int8 |",
    "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in records:
    name = f"**{r['path']}**" if r["path"] == "q8 xla" else r["path"]
    lines.append(
      f"| {r['k']} | {r['m']} | {r['act']} | {name} | {r['ms']:.3f} | {r['mb']:.1f}"
      f" | {r['gbs']:.1f} | {100 * r['bw']:.0f}% | {r['vs_bf16']:.2f}x | {r['vs_qwix']:.1f}x |"
    )
  return "\n".join(lines)


def section(body: str, header: str, command: str) -> str:
  return "\n".join(
    [
      START,
      HEADING,
      "",
      header,
      "",
      f"Command: `{command}`",
      "",
      "Each time: the least of 3 medians of 10 calls (2 of 8 with `--quick`), the rounds"
      " interleaved across the four paths; calls rotate through weight copies totalling > 3x the"
      " 32 MiB L3 (each call reads its weight from DRAM), every call waited for. Bytes: the weight as that path stores"
      " it (float32, bfloat16, Qwix int8 + float32 scales, Q8_0 int8 + float16 scales) plus x and"
      " y. Speeds are time ratios (> 1: faster than that path). Each K x N product reads its"
      " weight once, so on this machine the Q8_0 bytes set a floor of"
      " about K * N * 1.0625 / read-bandwidth.",
      "",
      body,
      END,
    ]
  )


def write_results(text: str) -> None:
  """Put `text` between the CPU markers of RESULTS.md, leaving other sections alone."""
  old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
  if START in old and END in old:
    head, rest = old.split(START, 1)
    tail = rest.split(END, 1)[1]
    new = head + text + tail
  else:
    new = old.rstrip("\n") + "\n\n" + text + "\n"
  RESULTS.write_text(new)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="K = N = 4096 only, fewer calls")
  parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
  parser.add_argument("--calls", type=int, default=None, help="timed calls per cell")
  parser.add_argument("--sizes", type=int, nargs="+", default=None, help="K = N values")
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="m values")
  args = parser.parse_args()
  sizes = args.sizes or ([4096] if args.quick else [4096, 8192])
  calls = args.calls or (8 if args.quick else 10)
  rounds = 2 if args.quick else 3
  now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  header = (
    f"Date: {now}. Machine: {machine()}. jax {jax.__version__}, jaxlib"
    f" {jaxlib.__version__},"
    f" qwix {qwix.__version__}, numpy {np.__version__}, backend {jax.default_backend()}."
    f" Load average at start: {load_average()}."
  )
  print(header, flush=True)
  records, bandwidth = run(sizes, args.rows, calls, rounds)
  header += f" Measured read bandwidth: {bandwidth:.1f} GB/s."
  body = table(records)
  print()
  print(body)
  if not args.no_write:
    command = " ".join(["python", "benchmarks/bench_cpu.py", *sys.argv[1:]])
    write_results(section(body, header, command))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
