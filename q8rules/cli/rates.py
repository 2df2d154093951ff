"""The speeds the command line prints, from the times tokens arrived.

The decode loop yields the first token alone (after the prompt's pass), then the rest a chunk
of `CHUNK` at a time (`q8rules.llm.generate`). The first chunk's time includes its program's
compilation (or its fetch from the compilation cache), so the decode rate is counted after it
when there are tokens after it: those tokens over the time since the first chunk arrived, as
`benchmarks/bench_decode.py` measures a warmed-up loop. With no token after the first chunk,
the rate is the tokens after the first over the time since the first arrived, compilation
included, and says so. Below 2 tokens there is no rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class DecodeRate:
  """tokens / seconds, and what they count."""

  tokens: int
  seconds: float
  warm: bool
  """True: counted after the first chunk (no compilation in it)."""
  left_out: int = 0
  """The tokens before those counted (the first and its chunk, when `warm`)."""

  @property
  def per_s(self) -> float | None:
    return self.tokens / self.seconds if self.tokens > 0 and self.seconds > 0 else None

  def describe(self) -> str:
    if self.per_s is None:
      return "n/a (fewer than 2 tokens)"
    if self.warm:
      what = (
        f" (the last {self.tokens} of {self.tokens + self.left_out}: the first"
        f" {self.left_out} wait on the decode program's compilation or cache fetch)"
      )
    else:
      what = " (with the decode program's compilation or cache fetch)"
    return f"{self.per_s:.1f} generated tokens/s over {self.tokens} tokens{what}"


def decode_rate(stamps: Sequence[float], chunk: int) -> DecodeRate:
  """The decode rate of tokens that arrived at `stamps` (perf_counter seconds, one per token,
  in order), the loop yielding `chunk` tokens a call after the first."""
  n = len(stamps)
  if n < 2:
    return DecodeRate(0, 0.0, False)
  if n > chunk + 1:
    return DecodeRate(n - 1 - chunk, stamps[-1] - stamps[chunk], True, chunk + 1)
  return DecodeRate(n - 1, stamps[-1] - stamps[0], False)


def prefill_rate(prompt_tokens: int, seconds: float) -> float:
  """Prompt tokens per second of the prompt's pass (compilation included)."""
  return prompt_tokens / seconds if seconds > 0 else float("inf")
