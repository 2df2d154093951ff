"""Wall-clock timing of calls into JAX: the one median timer of the demo and the benchmarks.

Every timed call is waited for (`jax.block_until_ready` on its result, any pytree; a result
with no arrays, such as `None` from a call into another library, is returned as it is), so a
time is the call's dispatch plus its computation, never the dispatch alone. Times are seconds
(`time.perf_counter`). Only stdlib and jax are imported: the core and the applications may
both use this module.

    median_time(f, x, w, warmup=1, reps=20)            # f(x, w): median seconds of 20 calls
    median_time(f, x, rotate=copies, reps=len(copies))  # f(x, copies[i]) for call i: each call
                                                        # reads another copy of the weight
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
  """Runs `fn(*args)` and waits for its result: (the result, seconds the call took)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def call_times(
  fn: Callable[..., Any],
  *args: Any,
  warmup: int = 1,
  reps: int = 10,
  rotate: Sequence[Any] | None = None,
) -> list[float]:
  """Seconds of each of `reps` calls `fn(*args)`, after `warmup` untimed calls (compilation,
  caches); every call, warm-up included, is waited for.

  With `rotate`, call i (warm-up calls counted) is `fn(*args, rotate[i % len(rotate)])`: each
  call gets the next item, e.g. a copy of a weight, so that no call finds its weight in a cache
  the previous one filled. The item is picked before the clock starts."""
  if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
    raise ValueError(f"warmup must be an int >= 0 (untimed calls), got {warmup!r}")
  if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
    raise ValueError(f"reps must be an int >= 1 (timed calls), got {reps!r}")
  if rotate is not None and len(rotate) == 0:
    raise ValueError("rotate must hold at least one item to pass to the calls, got none")

  def call_args(i: int) -> tuple[Any, ...]:
    return args if rotate is None else (*args, rotate[i % len(rotate)])

  for i in range(warmup):
    jax.block_until_ready(fn(*call_args(i)))
  return [timed_call(fn, *call_args(warmup + i))[1] for i in range(reps)]


def median_time(
  fn: Callable[..., Any],
  *args: Any,
  warmup: int = 1,
  reps: int = 10,
  rotate: Sequence[Any] | None = None,
) -> float:
  """Median seconds of `reps` calls `fn(*args)` after `warmup` untimed ones (see `call_times`,
  also for `rotate`)."""
  return statistics.median(call_times(fn, *args, warmup=warmup, reps=reps, rotate=rotate))
