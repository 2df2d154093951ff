"""GGUF's other tensor types requantized to Q8_0: the native library
(`q8rules.checkpoint.gguf.requant_native`) against gguf-py's numpy
(`gguf.quants.quantize(gguf.quants.dequantize(data, qtype), Q8_0)`), on the real files'
tensors (scripts/fetch_real_models.py), by type, and on random valid blocks of the types the
files lack.

    python benchmarks/bench_requant.py [--rounds 3] [--gguf-mb 8] [--write]

MB in: the tensors' bytes in the file. Native: best of `--rounds` over every tensor of the
type, on 1 thread and on this process's CPUs, into an output written once before (no page
faults timed). gguf.quants: its first `--gguf-mb` MB of each type's rows (it runs at one
speed whatever the size). Then each file whole: every quantized tensor requantized with the
default threads, new outputs each time (what a loader pays).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from q8rules.checkpoint.gguf import requant_native as rn  # noqa: E402
from q8rules.checkpoint.gguf.header import open_file  # noqa: E402
from q8rules.kernels.native import library as native_lib  # noqa: E402
from q8rules.kernels.native import simd as native_simd  # noqa: E402
from q8rules.kernels.native import threads as native_threads  # noqa: E402

FILES = ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf")
SYNTHETIC = (T.Q4_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.F16, T.BF16, T.F32)
"""Types the real files do not hold, benchmarked on random valid blocks (16M values)."""
FIELDS = {T.Q4_0: (0,), T.Q5_1: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q5_K: (0, 2)}
"""Byte offsets of the float16 fields (d, m or dmin) in a block of each synthetic type."""

NOTE = (
  "Threads: a 2-thread row reaches twice its 1-thread row only while the second core is idle;"
  " on a machine shared with other jobs (the load average above) it varies from run to run."
  " Seconds per file: every quantized tensor into new outputs (their page faults included),"
  " and the tensors that are not Q8_0 alone (what a loader that keeps Q8_0 as it is pays)."
)
"""The paragraph under the tables in RESULTS.md."""

Tensor = tuple[T, int, np.ndarray]  # type, values a row, (rows, bytes a row) uint8


def best(fn: Callable[[], object], rounds: int) -> float:
  """The shortest of `rounds` timed calls, in seconds."""
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return min(times)


def real_tensors(path: Path) -> list[Tensor]:
  """The file's quantized tensors (not its F32 norms), as 2-D uint8 rows."""
  out = []
  for t in open_file(path).tensors.values():
    if t.tensor_type != T.F32 and int(t.tensor_type) in rn.requant_native_types():
      rows = t.data.reshape(-1, t.data.shape[-1]).view(np.uint8)
      out.append((t.tensor_type, t.shape[-1], rows))
  return out


def synthetic(qtype: T, rng: np.random.Generator) -> Tensor:
  """16M values of random valid blocks of `qtype` (float16 fields finite), as (rows, bytes)."""
  n_rows, n_cols = 4096, 4096
  x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
  if qtype in (T.F32, T.F16, T.BF16):
    return qtype, n_cols, gguf.quants.quantize(x, qtype).view(np.uint8).reshape(n_rows, -1)
  values, nbytes = GGML_QUANT_SIZES[qtype]
  rows = rng.integers(0, 256, (n_rows, n_cols // values * nbytes), dtype=np.uint8)
  blocks = rows.reshape(-1, nbytes)
  for field in FIELDS[qtype]:
    scales = rng.uniform(1e-4, 1e-2, len(blocks)).astype(np.float16)
    blocks[:, field : field + 2] = scales.view(np.uint8).reshape(-1, 2)
  return qtype, n_cols, rows


def native_seconds(tensors: list[Tensor], threads: int, rounds: int) -> float:
  """Best time to requantize all `tensors` on `threads` threads, into outputs touched before."""
  outs = [rn.requantize_q8_0_native(r, int(q), len(r), n, threads=threads) for q, n, r in tensors]

  def run() -> None:
    for (q, n, r), out in zip(tensors, outs, strict=True):
      rn.requantize_q8_0_native(r, int(q), len(r), n, out, threads=threads)

  return best(run, rounds)


def gguf_seconds(tensors: list[Tensor], budget: int) -> tuple[float, int]:
  """gguf.quants' time on the first `budget` bytes of `tensors`' rows, and the bytes run."""
  spent, done = 0.0, 0
  for qtype, _, rows in tensors:
    take = rows[: max(1, (budget - done) // rows.shape[1])]
    t = time.perf_counter()
    gguf.quants.quantize(gguf.quants.dequantize(take, qtype), T.Q8_0)
    spent += time.perf_counter() - t
    done += take.nbytes
    if done >= budget:
      break
  return spent, done


def requantize_all(tensors: list[Tensor]) -> list[np.ndarray]:
  """All `tensors` requantized with the default threads, into new outputs."""
  return [rn.requantize_q8_0_native(r, int(q), len(r), n) for q, n, r in tensors]


def table(by_type: dict[T, list[Tensor]], args: argparse.Namespace, source: str) -> list[str]:
  """One row per type and thread count: MB in, MB/s native and gguf.quants."""
  rows = []
  for qtype, tensors in by_type.items():
    mb = sum(r.nbytes for _, _, r in tensors) / 1e6
    gguf_s, gguf_bytes = gguf_seconds(tensors, args.gguf_mb * 10**6)
    gguf_rate = gguf_bytes / 1e6 / gguf_s
    for threads in sorted({1, native_threads.cpus()}):
      rate = mb / native_seconds(tensors, threads, args.rounds)
      rows.append(
        f"| {qtype.name} | {source} | {mb:.1f} | {rate:.0f} | {gguf_rate:.1f} |"
        f" {rate / gguf_rate:.0f}x | {threads} |"
      )
      print(rows[-1], flush=True)
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dir", type=Path, default=None, help="default: $Q8RULES_MODEL_DIR")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--gguf-mb", type=int, default=8, help="MB of each type gguf.quants runs")
  ap.add_argument("--write", action="store_true", help="write the tables to RESULTS.md")
  args = ap.parse_args()
  if not native_lib.available():
    raise SystemExit(f"the native library is unavailable: {native_lib.unavailable_reason()}")
  base = args.dir or Path(
    os.environ.get("Q8RULES_MODEL_DIR") or Path.home() / ".cache" / "q8rules" / "models"
  )
  files = {name: real_tensors(base / name) for name in FILES if (base / name).exists()}
  by_type: dict[T, list[Tensor]] = collections.defaultdict(list)
  for tensors in files.values():
    for t in tensors:
      by_type[t[0]].append(t)
  head = "| type | tensors | MB in | MB/s native | MB/s gguf.quants | native / gguf | threads |"
  lines = [head, "|---|---|---|---|---|---|---|"]
  print("\n".join(lines))
  lines += table(dict(sorted(by_type.items())), args, "real files")
  rng = np.random.default_rng(0)
  lines += table({q: [synthetic(q, rng)] for q in SYNTHETIC if q not in by_type}, args, "random")
  whole = ["| file | tensors | MB in | seconds, all | MB in, not Q8_0 | seconds, not Q8_0 |"]
  whole.append("|---|---|---|---|---|---|")
  for name, tensors in files.items():
    other = [t for t in tensors if t[0] != T.Q8_0]
    mb, mb_other = (sum(r.nbytes for _, _, r in ts) / 1e6 for ts in (tensors, other))
    secs = [best(functools.partial(requantize_all, ts), args.rounds) for ts in (tensors, other)]
    whole.append(
      f"| {name} | {len(tensors)} | {mb:.0f} | {secs[0]:.3f} | {mb_other:.0f} | {secs[1]:.3f} |"
    )
    print(whole[-1])
  if args.write:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    header = (
      f"Date: {now}. Machine: {machine()}. Load average at the end: {load_average()}."
      f" Native quantizer path: {native_simd.isa('selected')}."
    )
    cmd = "python " + " ".join(["benchmarks/bench_requant.py", *sys.argv[1:]])
    text = section(
      "requant",
      "## GGUF types requantized to Q8_0 (native vs gguf.quants, CPU)",
      header,
      cmd,
      ["\n".join(lines), "\n".join(whole), NOTE],
    )
    write_section("requant", text)


if __name__ == "__main__":
  main()
