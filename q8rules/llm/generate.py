"""`GGUFModel.stream`'s decode: one request on the engine's runner (`q8rules.engine.runner`),
the program `q8rules serve` decodes with, on one slot.

The prompt is prefilled in one pass (the runner's prefill takes a chunk of any length), which
samples the first token; then the runner decodes up to `CHUNK` tokens per device call (a loop
on the device, the sampled token fed back), the next call dispatched before the current one's
tokens are read, so the caller's work on them overlaps the device's. Sampling is the engine's
chain (`q8rules.engine.chain.sample_rows`) with the request's settings as arrays: greedy is the
argmax, otherwise each sampled token splits the key once, so a seed gives the same tokens.

    runner = BatchRunner(model, 1, context, steps=CHUNK, history=history_length(params))
    for token in stream_tokens(runner, prompt_ids, 32, params, stop_ids=[2]):
      ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from q8rules.engine.runner import BatchRunner, Step
from q8rules.engine.sampling import HISTORY, RowSettings, SamplingParams, history_of

CHUNK = 16
"""Decode steps per device call in `GGUFModel.stream` (tokens are yielded a chunk at a time)."""


def history_length(params: SamplingParams) -> int:
  """The recent ids the decode keeps for `params`' penalties: `HISTORY`, or more when a
  penalty is on and `penalty_last_n` asks for more."""
  return max(HISTORY, params.penalty_last_n) if params.penalized else HISTORY


def stream_tokens(
  runner: BatchRunner,
  prompt_ids: np.ndarray,
  max_new_tokens: int,
  params: SamplingParams,
  stop_ids: Sequence[int] = (),
  on_prefill: Callable[[], None] | None = None,
) -> Iterator[int]:
  """Yield the tokens after `prompt_ids` (T,) int32 on slot 0 of `runner` (whose context holds
  T + `max_new_tokens` positions and whose history `history_length(params)` ids), sampled with
  `params`: up to `max_new_tokens`, or through the first token in `stop_ids`. `on_prefill` is
  called once the prompt's pass and its first token are done (for timing)."""
  runner.free(0)
  runner.set_settings(0, params)
  history = history_of(prompt_ids, runner.history)
  one = RowSettings.of([params])
  first = runner.prefill(0, prompt_ids, 0, params.key(), history, one, last=True)
  first.out[0].block_until_ready()
  if on_prefill is not None:
    on_prefill()
  if max_new_tokens < 1:
    return
  stops = set(int(i) for i in stop_ids)
  token = int(first.fetch(logprobs=False).tokens[0, 0])
  yield token
  if token in stops:
    return
  launched = 1

  def launch() -> tuple[int, Step] | None:
    """The next chunk (its length, its dispatched `Step`), or None past `max_new_tokens`."""
    nonlocal launched
    n = min(CHUNK, max_new_tokens - launched)
    if n < 1:
      return None
    launched += n
    return n, runner.decode(n)

  pending = launch()
  while pending is not None:
    n, step = pending
    pending = launch()  # out before this chunk's tokens are read (dropped unread after a stop)
    for t in step.fetch(logprobs=False).tokens[:n, 0].tolist():
      yield t
      if t in stops:
        return


__all__ = ["CHUNK", "history_length", "stream_tokens"]
