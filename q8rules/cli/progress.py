"""Progress bars on a terminal only, and log lines that never share a line with a bar.

A bar redraws its line with carriage returns, which a log file would keep: stderr redirected to
a file gets no bar (tqdm's `disable=None`; `load_gguf(progress=None)`), only the one line each
phase prints. A log line written while a bar is up goes through `tqdm.write`, which clears the
bar, prints the line and draws the bar again below it.
"""

from __future__ import annotations

import sys
from typing import Any


def bars(no_progress: bool) -> bool | None:
  """`progress=` for `load_gguf`: False with --no-progress, else None (on a terminal only)."""
  return False if no_progress else None


def bar(total: int, no_progress: bool, **kwargs: Any) -> Any:
  """A tqdm bar of `total` on stderr when it is a terminal (and not --no-progress); advanced by
  `.update(1)`. Disabled, its methods do nothing."""
  from tqdm.auto import tqdm

  return tqdm(total=total, disable=True if no_progress else None, file=sys.stderr, **kwargs)


def say(line: str) -> None:
  """Print `line` on stderr on a line of its own, above any bar."""
  from tqdm.auto import tqdm

  tqdm.write(line, file=sys.stderr)


__all__ = ["bar", "bars", "say"]
