"""`--threads N`: this process on N CPUs, set before JAX starts its CPU backend.

The process's CPU affinity is cut to N of its CPUs (what `taskset` does: XLA's thread pool, the
native kernels' threads and everything else then share those N), and XLA's CPU backend is told
N threads for its ops. It must run before the first JAX computation: the backend reads its
flags once, when it starts."""

from __future__ import annotations

import argparse
import os

from q8rules.cli.errors import UsageError, positive_int


def add_threads(p: argparse.ArgumentParser) -> None:
  """The `-t/--threads N` option (`limit_threads` applies it before the command runs)."""
  p.add_argument("-t", "--threads", type=positive_int, default=None,
                 help="CPUs to run on (None: all this process may use)")  # fmt: skip


def limit_threads(n: int) -> list[int]:
  """Run this process on `n` of its CPUs; the CPUs it now runs on."""
  have = sorted(os.sched_getaffinity(0))
  if n > len(have):
    raise UsageError(f"--threads {n}: this process may use {len(have)} CPU(s)")
  os.sched_setaffinity(0, have[:n])
  flag = f"--xla_cpu_multi_thread_eigen={'true' if n > 1 else 'false'}"
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_multi_thread_eigen" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag} intra_op_parallelism_threads={n}".strip()
  return have[:n]
