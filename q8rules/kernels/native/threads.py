"""How many threads a native call runs on.

A native call (a product, a transposed product, a repack, a requantization) runs on the calling
thread and up to `max_threads() - 1` helpers: by default every CPU this process may run on (its
affinity mask: `taskset`, `q8rules run -t N`), at most `set_threads(n)` / `$Q8RULES_THREADS`
when set (`settings`; docs/kernels.md, "Threads", says how the work is split). A product's
helpers are the library's own threads, which spin `$Q8RULES_SPIN_US` microseconds
(`settings.spin_us()`) for the next product before they sleep; a product that finds them busy
(another thread's product) takes threads of XLA's pool instead.
"""

from __future__ import annotations

import ctypes
import os

from q8rules.kernels.native import library, settings


def cpus() -> int:
  """The threads a native call may use: the CPUs this process may run on (a `taskset` is
  honoured), at most the limit of `set_threads` / `$Q8RULES_THREADS`."""
  try:
    n = max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # not Linux
    n = max(1, os.cpu_count() or 1)
  limit = settings.thread_limit()
  return min(n, limit) if limit else n


def set_threads(n: int | None) -> None:
  """Run each native call on at most `n` threads, the caller included (None: as many as the
  process's CPUs; this replaces `$Q8RULES_THREADS`). Process-wide, from the next call on; the
  outputs are the same bit for bit whatever the threads (the work is cut by the problem alone).
  """
  if n is not None:
    settings.positive(n, "threads")
  settings.store_limit(n)
  lib = library.library()
  if lib is not None:
    lib.Q8SetThreadLimit(ctypes.c_int(n or 0))


def max_threads() -> int:
  """The threads a native call may use now (the caller included): `cpus()`; 0 when the
  library is unavailable."""
  lib = library.library()
  return 0 if lib is None else int(lib.Q8MaxThreads())


def last_threads() -> int:
  """The threads (the caller and pool helpers) the kernel's last call ran on: 0 before the
  first call or when the kernel is unavailable."""
  lib = library.library()
  return 0 if lib is None else int(lib.Q8GemvLastThreads())
