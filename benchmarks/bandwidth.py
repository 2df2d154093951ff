"""The memory read bandwidth of this machine, as the decode benchmarks' yardstick: `threads`
threads each read their own slice of a buffer far larger than the last-level cache with the
widest vector loads the CPU has (`read_probe.c`, built here with the system C compiler for
this CPU), best of several reads.

    python benchmarks/bandwidth.py [--threads 1,2] [--gib 1]

A decode step of a weight-bound model reads its weights once: its GB/s over this probe's is
the fraction of the physical limit it reaches (`bench_decode.py` reports it).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("read_probe.c")
FLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC")


@functools.cache
def _library() -> ctypes.CDLL:
  """The probe, compiled once per source and compiler into a cache folder."""
  cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    raise RuntimeError("the bandwidth probe needs a C compiler (cc or gcc, or $CC)")
  key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + " ".join(FLAGS).encode()).hexdigest()
  folder = Path(tempfile.gettempdir()) / "q8rules-read-probe"
  folder.mkdir(exist_ok=True)
  lib = folder / f"read_probe-{key[:16]}.so"
  if not lib.exists():
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True)
    tmp.replace(lib)
  out = ctypes.CDLL(str(lib))
  out.ReadBandwidth.argtypes = (ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
  out.ReadBandwidth.restype = ctypes.c_double
  return out


def read_bandwidth(threads: int, gib: float = 1.0, reps: int = 7) -> float:
  """GB/s (1e9 bytes a second) of `threads` threads reading a `gib` GiB buffer: the best of
  `reps` reads."""
  rate = _library().ReadBandwidth(int(gib * (1 << 30)), int(threads), int(reps))
  if rate <= 0:
    raise MemoryError(f"the bandwidth probe could not allocate {gib} GiB")
  return rate / 1e9


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--threads", default="1,2")
  ap.add_argument("--gib", type=float, default=1.0)
  args = ap.parse_args()
  for t in (int(x) for x in args.threads.split(",")):
    print(f"{t} thread(s): {read_bandwidth(t, args.gib):.1f} GB/s")


if __name__ == "__main__":
  main()
