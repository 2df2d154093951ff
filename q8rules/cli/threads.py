"""`--threads N`: this process on N CPUs, set before JAX starts its CPU backend.

The process's CPU affinity is cut to N of its CPUs (what `taskset` does: XLA's thread pool, the
native kernels' threads and everything else then share those N), and XLA's CPU backend is told
N threads for its ops. It must run before the first JAX computation: the backend reads its
flags once, when it starts."""

from __future__ import annotations

import os

from q8rules.cli.errors import UsageError


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
