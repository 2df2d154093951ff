"""What the environment and `threads.set_threads` ask of the native library's threads: the
limit on a call's threads (`$Q8RULES_THREADS`, or the process-wide `set_threads(n)`) and how
long a product's helpers spin for the next product (`$Q8RULES_SPIN_US`). `library` applies both
when it loads the library; `threads` sizes the calls with them.
"""

from __future__ import annotations

import os

THREADS_ENV = "Q8RULES_THREADS"
"""The environment variable of the native calls' thread limit (a positive integer)."""

SPIN_ENV = "Q8RULES_SPIN_US"
"""The environment variable of the time a product's helper threads spin for the next product
before they sleep, in microseconds (a non-negative integer; 0: they sleep at once)."""

DEFAULT_SPIN_US = 200
"""`spin_us()` when `$Q8RULES_SPIN_US` is not set: long enough to span the other work between
two products of a decode step, short enough that an idle process soon stops spinning."""

_limit: dict[str, int | None] = {}  # "threads": set_threads's limit, once it has been called


def positive(n: object, what: str) -> int:
  """`n` when it is a positive int (not a bool), else ValueError naming `what`."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"{what} must be a positive integer (threads per native call), got {n!r}")
  return n


def store_limit(n: int | None) -> None:
  """Remember `set_threads(n)`'s limit (None: no limit), which then replaces the variable's."""
  _limit["threads"] = n


def forget_limit() -> None:
  """Forget `set_threads`'s limit: `$Q8RULES_THREADS` holds again (tests, `library.reset`)."""
  _limit.pop("threads", None)


def thread_limit() -> int | None:
  """The limit on a native call's threads: `set_threads`'s, else `$Q8RULES_THREADS`, else None
  (every CPU this process may run on). ValueError naming the variable when it is not a
  positive integer."""
  if "threads" in _limit:
    return _limit["threads"]
  text = os.environ.get(THREADS_ENV, "").strip()
  if not text:
    return None
  try:
    return positive(int(text), f"${THREADS_ENV}={text!r}")
  except ValueError:
    raise ValueError(
      f"${THREADS_ENV}={text!r} must be a positive integer (threads per native call)"
    ) from None


def spin_us() -> int:
  """How long a product's helper threads spin for the next product before they sleep
  (microseconds): `$Q8RULES_SPIN_US`, else `DEFAULT_SPIN_US`. ValueError naming the variable
  when it is not a non-negative integer. Read when the library loads."""
  text = os.environ.get(SPIN_ENV, "").strip()
  if not text:
    return DEFAULT_SPIN_US
  try:
    us = int(text)
  except ValueError:
    us = -1
  if us < 0:
    raise ValueError(f"${SPIN_ENV}={text!r} must be a non-negative integer (microseconds)")
  return us
