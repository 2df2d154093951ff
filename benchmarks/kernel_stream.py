"""The CPU product's column loop alone, on one and two threads, against the read bandwidth: how
close the kernel's own streaming comes to the memory's limit, without XLA, the FFI or a thread
pool's wake-ups (which `bench_threads.py` and `bench_decode.py` include).

    python benchmarks/kernel_stream.py [--write]

`kernel_stream.cc` includes the library's own headers (`q8rules/kernels/cpu/`) and is built
here with the library's compiler and code-generation flags; per shape of the decode benchmark's models it times
one product (m = 1, weights from DRAM) on the caller alone, and with K split in two halves
between the caller and a spinning helper. GB/s: the Q8_0 weight's bytes over the time, and that
as a fraction of `bandwidth.py`'s probe at the same threads.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bandwidth import read_bandwidth  # noqa: E402
from benchmarks.bench_threads import SHAPES, report  # noqa: E402

SOURCE = Path(__file__).with_name("kernel_stream.cc")


def build() -> Path:
  """kernel_stream.cc compiled against the library's headers with its compiler and flags."""
  import jax

  from q8rules.kernels.native import library as native_lib

  out = Path(tempfile.mkdtemp(prefix="q8rules-kernel-stream-")) / "kernel_stream"
  headers = Path(native_lib.SOURCE).parent
  # the library's code-generation flags (its warnings left out: GCC 12's AVX-512 headers warn
  # of an uninitialized value inside their own intrinsics when main() inlines them)
  flags = [f for f in native_lib.CXXFLAGS if f not in ("-shared", "-fPIC") and f[:2] != "-W"]
  cmd = [*native_lib.compiler(), *flags, "-I", str(headers), "-isystem", jax.ffi.include_dir()]
  subprocess.run([*cmd, str(SOURCE), "-o", str(out)], check=True)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--write", action="store_true", help="write RESULTS.md's `kernel-stream`")
  args = ap.parse_args()
  exe = build()
  probe = {t: read_bandwidth(t, gib=2.0) for t in (1, 2)}
  lines = [
    "| product | K | N | 1 thread us (GB/s, of the read bandwidth) |"
    " 2 threads us (GB/s, of the read bandwidth) |",
    "|---|---:|---:|---:|---:|",
  ]
  for name, (k, n) in SHAPES.items():
    cells = []
    for t in (1, 2):
      out = subprocess.run([str(exe), str(k), str(n), str(t)], capture_output=True, text=True)
      us, gbs = (float(v) for v in out.stdout.split())
      cells.append(f"{us:.0f} ({gbs:.1f}, {gbs / probe[t]:.0%})")
    lines.append(f"| {name} | {k} | {n} | " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  heading = "## The CPU product's column loop alone (C++, no XLA), from DRAM"
  report("kernel-stream", heading, "kernel_stream.py", probe, lines, args.write)


if __name__ == "__main__":
  main()
