"""The engine: a queue of requests, one slot of the batched cache per running request, and the
loop that interleaves prompt chunks with decode steps.

One thread runs the loop (`Scheduler.start`); the API's handlers `submit` requests and read
each request's events from its own queue. Each turn of the loop:

  1. takes in what was submitted, drops what was cancelled (a cancelled request frees its slot
     at once) and gives the free slots to the oldest waiting requests, each the slot whose
     cache holds the longest start of its prompt (`prefix_cache`: only the rest is prefilled);
  2. prefills prompt chunks of the requests still in their prompts, oldest first, up to
     `runner.chunk` tokens in all (`runner.CHUNK` by default; at least one chunk), so a long
     prompt never stalls the running streams for more than a chunk;
  3. starts decode steps for all slots: one while a prompt waits for its next chunk (or a
     waiting request for a free slot), else up to `runner.steps` in one device program (fewer
     when every running request needs fewer), so the host's work per program is shared by
     several tokens;
  4. hands out the tokens of the programs started before it: the device runs the steps while
     the host hands out the last program's tokens (the rows' state stays on the device, so a
     step needs nothing from the host). A request that ends there had more tokens computed
     for it by the program already running; they are dropped, and its slot is freed before the
     next program.

A request ends at an end-of-generation id or a stop string ('stop'), after `max_tokens` or at
the end of its slot's context ('length'), when cancelled, or when the engine stops (its stream
gets a final error event).

Faults stay with the request they hit (an exception while admitting it: a 400 `ErrorEvent`;
while prefilling or handing out its tokens: a 500; its slot freed, the others go on). One the
loop cannot pin on a request (a decode program's) ends the engine: every request gets a 503 at
once, `alive` turns False, `failure` holds it and `submit` raises `EngineDown`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from q8rules.engine.constraints import constrained, first_mask, set_masks, take
from q8rules.engine.detokenize import TextStream
from q8rules.engine.metrics import EngineState, Metrics
from q8rules.engine.prefix_cache import PrefixCache
from q8rules.engine.runner import BatchRunner, Sampled, Step, chunks
from q8rules.engine.sampling import RowSettings, SamplingParams, history_of


@dataclasses.dataclass
class TokenEvent:
  """New output of a request: text (possibly empty, held back at a partial character or a
  possible stop string) and the tokens behind it.

  Attributes:
    text: the new text.
    token_ids: the new tokens.
    logprobs: per new token (token id, its log-probability, [(id, log-probability)] of the
      most likely `top_logprobs`), when the request asked for them.
  """

  text: str
  token_ids: list[int]
  logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class DoneEvent:
  """A request's end: `finish_reason` 'stop' or 'length' (or 'cancelled', 'shutdown'), the
  text not yet sent, and the counts for `usage`."""

  finish_reason: str
  text: str
  prompt_tokens: int
  completion_tokens: int


@dataclasses.dataclass
class ErrorEvent:
  """The engine failed on this request (or stopped under it): the message, and the HTTP status
  it stands for."""

  message: str
  status: int = 500


Event = TokenEvent | DoneEvent | ErrorEvent

log = logging.getLogger("q8rules.serve")


class EngineDown(RuntimeError):
  """The engine takes no more requests: it is stopping, or it failed (`Scheduler.failure`)."""


@dataclasses.dataclass
class Request:
  """One completion request as the engine runs it.

  Attributes:
    prompt_ids: the prompt's token ids (at least one; fits the context with `max_tokens`).
    max_tokens: the most tokens to generate (>= 1).
    params: its sampling settings.
    stop: stop strings (the text ends before the first one found).
    stop_ids: ids that end it (the vocabulary's end-of-generation ids); not part of the text.
    emit: called (from the engine's thread) with each event; `Request.queue_for` makes one
      that feeds an asyncio queue.
    rid: the request's id in the API's response and the log.
    arrived: when the API took it in (perf_counter seconds; default: when made), for the time
      to first token and the duration.
    grammar: what constrains its tokens (`q8rules.engine.constraints`), or None.
    special: its text writes control tokens out (`TextStream`'s `special`).
  """

  prompt_ids: list[int]
  max_tokens: int
  params: SamplingParams
  stop: list[str]
  stop_ids: frozenset[int]
  emit: Callable[[Event], None]
  rid: str = ""
  arrived: float | None = None
  grammar: Any = None
  special: bool = False
  id: int = dataclasses.field(default_factory=itertools.count().__next__)
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  cancelled: bool = False
  slot: int | None = None
  prefilled: int = 0
  generated: list[int] = dataclasses.field(default_factory=list)
  text: TextStream | None = None
  plan: list[int] = dataclasses.field(default_factory=list)
  key: np.ndarray | None = None
  history: np.ndarray | None = None
  first_token_at: float | None = None
  last_token_at: float = 0.0
  ended: bool = False
  pending: int = 0

  def __post_init__(self) -> None:
    if self.arrived is None:
      self.arrived = self.submitted

  @staticmethod
  def queue_for(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Queue, Callable[[Event], None]]:
    """An asyncio queue on `loop` and an `emit` that puts events on it from any thread (once
    the loop is closed, nobody listens: the event is dropped)."""
    queue: asyncio.Queue = asyncio.Queue()

    def emit(event: Event) -> None:
      try:
        loop.call_soon_threadsafe(queue.put_nowait, event)
      except RuntimeError:  # the loop is closed
        pass

    return queue, emit

  def cancel(self) -> None:
    """Ask the engine to drop this request (its slot is freed at the loop's next turn)."""
    self.cancelled = True


class Scheduler:
  """The engine over a `BatchRunner`: `submit` a `Request`, read its events.

  Args:
    runner: the batched cache and programs.
    tokenizer: the model's `GGUFTokenizer` (for the text and the stop strings), or None.

  Attributes:
    metrics: its counters and histograms (`q8rules.engine.metrics`).
    prefixes: what each slot's cache row holds of its prompts (`q8rules.engine.prefix_cache`).
    failure: the exception that ended the engine, or None.
  """

  def __init__(self, runner: BatchRunner, tokenizer: Any):
    self.runner = runner
    self.tokenizer = tokenizer
    self.metrics = Metrics()
    self.metrics.watch(self.state)
    self.failure: BaseException | None = None
    self.slots: list[Request | None] = [None] * runner.slots
    self.waiting: collections.deque[Request] = collections.deque()
    self._incoming: collections.deque[Request] = collections.deque()
    self._wake = threading.Condition()
    self._stop = False
    self._thread: threading.Thread | None = None
    self._started: collections.deque[Started] = collections.deque()
    self._last_done = 0.0
    self.prefixes = PrefixCache(runner.slots, runner.chunk, runner.keeps_prefixes)

  # --- the API's side -------------------------------------------------------------------------

  def submit(self, request: Request) -> None:
    """Queue `request` (from any thread).

    Raises:
      EngineDown: the engine failed or is stopping.
    """
    with self._wake:
      if self.failure is not None:
        raise EngineDown(f"the engine failed ({self.failure_message()})")
      if self._stop:
        raise EngineDown("the server is shutting down")
      self._incoming.append(request)
      self._wake.notify()

  def wake(self) -> None:
    """Make the loop look again (after a `Request.cancel`)."""
    with self._wake:
      self._wake.notify()

  @property
  def running(self) -> int:
    return sum(r is not None for r in self.slots)

  @property
  def queued(self) -> int:
    return len(self.waiting) + len(self._incoming)

  @property
  def alive(self) -> bool:
    """Whether the engine runs: started, not stopped, not failed."""
    thread = self._thread
    return thread is not None and thread.is_alive() and not self._stop and self.failure is None

  def state(self) -> EngineState:
    return EngineState(self.running, self.queued, self.runner.slots, self.alive)

  def failure_message(self) -> str:
    e = self.failure
    return "" if e is None else f"{type(e).__name__}: {e}"

  def start(self) -> None:
    """Run the loop in a daemon thread."""
    self._thread = threading.Thread(target=self._run, name="q8rules-engine", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 30.0) -> None:
    """End the loop: every running and waiting request gets a final `ErrorEvent` (503)."""
    with self._wake:
      self._stop = True
      self._wake.notify()
    if self._thread is not None:
      self._thread.join(timeout)

  # --- the loop -------------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while self._turn():
        pass
    except BaseException as e:  # the engine is dead: say so, and tell everyone at once
      with self._wake:
        self.failure = e
      log.critical("the engine failed; every request is answered 503", exc_info=e)
      self._end_all(f"the engine failed ({self.failure_message()}); the server is stopping", 503)
      return
    self._end_all("the server is shutting down", 503)

  def _end_all(self, message: str, status: int) -> None:
    with self._wake:
      self._stop = True
      everyone = [*self.waiting, *self._incoming, *(r for r in self.slots if r is not None)]
      self.waiting.clear()
      self._incoming.clear()
      self.slots = [None] * len(self.slots)
      self._started.clear()
    for r in everyone:
      r.ended = True
      self.metrics.requests["aborted"] += 1
      r.emit(ErrorEvent(message, status))

  def _fail(self, r: Request, error: Exception, status: int, stage: str) -> None:
    """End `r` alone after `error` (while `stage`): logged with its id, its slot freed, an
    `ErrorEvent` with `status` (400: its values caused it; 500: the server failed)."""
    log.error("request %s failed while %s", r.rid or r.id, stage, exc_info=error)
    r.ended = True
    if r.slot is not None and self.slots[r.slot] is r:
      self.slots[r.slot] = None
      self.runner.free(r.slot)
    self.metrics.request_ended("error", time.perf_counter() - r.arrived)
    what = "the request's values could not be used" if status == 400 else "the server failed"
    r.emit(ErrorEvent(f"{what} while {stage}: {type(error).__name__}: {error}", status))

  def _turn(self) -> bool:
    """One turn of the loop; False once stopped."""
    with self._wake:
      while not self._stop and not self._incoming and not self._busy():
        self._wake.wait(timeout=0.5)
      if self._stop:
        return False
      self.waiting.extend(self._incoming)
      self._incoming.clear()
    self._drop_cancelled()
    self._admit()
    self._prefill_some()
    decoding = self._decoding()
    if constrained(decoding):  # each mask needs the token before it: hand out, then one step
      while self._started:
        self._hand_out(self._started.popleft())
      decoding = self._decoding()
      set_masks(self.runner, decoding)
    if decoding:
      n = 1 if constrained(decoding) else self._steps(decoding)
      for _, r in decoding:
        r.pending += n
      self._started.append(Started(self.runner.decode(n), decoding, time.perf_counter(), n))
    while len(self._started) > (1 if decoding else 0):  # the step just started keeps running
      self._hand_out(self._started.popleft())
    return True

  def _decoding(self) -> list[tuple[int, Request]]:
    return [(i, r) for i, r in enumerate(self.slots) if r is not None and not r.plan]

  def _steps(self, decoding: list[tuple[int, Request]]) -> int:
    """The decode steps of the next program: 1 while a prompt waits for its next chunk or a
    waiting request for a slot that is free; else, at most `runner.steps`, as many as the
    running request that needs the most may still use (the one that needs the fewest, while
    requests wait: its slot is freed sooner)."""
    if any(r is not None and r.plan for r in self.slots) or (
      self.waiting and any(r is None for r in self.slots)
    ):
      return 1
    most = min if self.waiting else max
    left = most(r.max_tokens - len(r.generated) - r.pending for _, r in decoding)
    return max(1, min(self.runner.steps, left))

  def _busy(self) -> bool:
    return bool(self.waiting or self._started) or any(r is not None for r in self.slots)

  def _drop_cancelled(self) -> None:
    for r in [r for r in self.waiting if r.cancelled]:
      self.waiting.remove(r)
      self._finish(r, "cancelled")
    for r in self.slots:
      if r is not None and r.cancelled:
        self._finish(r, "cancelled")

  def _admit(self) -> None:
    """The waiting requests, oldest first, into the free slots: each into the one whose cache
    holds the longest start of its prompt (`PrefixCache.choose`)."""
    while self.waiting and None in self.slots:
      nxt = self.waiting.popleft()
      free = [i for i, r in enumerate(self.slots) if r is None]
      try:
        self._take_slot(nxt, self.prefixes.choose(nxt.prompt_ids, free))
      except Exception as e:
        self._fail(nxt, e, 400, "admitting it")

  def _take_slot(self, r: Request, i: int) -> None:
    """`r` gets slot `i`: its prompt's chunks (after what the slot's cache holds of it), key,
    recent ids, text and settings."""
    r.slot = i
    r.prefilled = reused = self.prefixes.take(r.prompt_ids, i)
    r.plan = chunks(len(r.prompt_ids) - reused, self.runner.chunk)
    r.key = r.params.key()
    r.history = history_of(r.prompt_ids)
    r.text = TextStream(self.tokenizer, r.stop, special=r.special)
    self.slots[i] = r
    self.runner.set_settings(i, r.params)
    self.metrics.prompt_tokens += len(r.prompt_ids)
    self.metrics.prompt_tokens_reused += reused
    self.metrics.queue_time.observe(time.perf_counter() - r.submitted)

  def _prefill_some(self) -> None:
    """Prompt chunks of the requests still in their prompts, oldest first, up to `runner.chunk`
    tokens in all (at least one chunk): running streams wait at most that long a turn."""
    budget = self.runner.chunk
    for r in sorted((r for r in self.slots if r is not None and r.plan), key=lambda r: r.submitted):
      while r.plan and not r.ended and (budget == self.runner.chunk or r.plan[0] <= budget):
        budget -= r.plan[0]
        try:
          self._prefill(r)
        except Exception as e:
          self._fail(r, e, 500, "prefilling its prompt")
      if budget <= 0:
        return

  def _prefill(self, r: Request) -> None:
    t = r.plan.pop(0)
    ids = np.asarray(r.prompt_ids[r.prefilled : r.prefilled + t], np.int32)
    one = RowSettings.of([r.params])
    allowed = None if r.plan else first_mask(r.grammar, self.runner.vocab)
    step = self.runner.prefill(r.slot, ids, r.prefilled, r.key, r.history, one, not r.plan, allowed)
    self.prefixes.wrote(r.prompt_ids, r.slot, r.prefilled, t)
    r.prefilled += t
    if not r.plan:  # its first token, handed out after the steps started before it
      r.pending += 1
      self._started.append(Started(step, [(0, r)], time.perf_counter(), 1, prompt=True))

  def _hand_out(self, started: Started) -> None:
    """Each request of `started` gets its tokens, step after step, while it runs (a request
    that ended after the program started gets none after its end)."""
    for _, r in started.rows:
      r.pending -= started.steps
    live = [(row, r) for row, r in started.rows if not r.ended]
    out = started.step.fetch(logprobs=any(r.params.logprobs for _, r in live))
    done = time.perf_counter()
    if not started.prompt:
      seconds = done - max(started.at, self._last_done)
      self._last_done = done
      self.metrics.decode_steps += started.steps
      self.metrics.recent_decode.append((done, len(live) * started.steps, seconds))
    before = [len(r.generated) for _, r in live]
    for step in range(started.steps):
      for row, r in live:
        if r.ended:
          continue
        try:
          self._accept(r, out, step, row)
        except Exception as e:
          self._fail(r, e, 500, "handing out its tokens")
    for (_, r), n in zip(live, before, strict=True):
      self._timed(r, len(r.generated) - n, started, done)

  def _timed(self, r: Request, got: int, started: Started, done: float) -> None:
    """The histograms for `r`'s `got` tokens from `started`, handed out at `done`: its first
    token's delay, or the time since its last tokens shared by this program's steps."""
    if started.prompt:
      r.first_token_at = done
      self.metrics.time_to_first_token.observe(done - r.arrived)
    elif got > 0 and r.last_token_at:
      gap = (done - r.last_token_at) / started.steps
      for _ in range(got):
        self.metrics.inter_token_latency.observe(gap)
    r.last_token_at = done

  def _accept(self, r: Request, out: Sampled, step: int, row: int) -> None:
    """Request `r` gets its next token from step `step`, row `row` of `out`."""
    tok = int(out.tokens[step, row])
    self.metrics.generated_tokens += 1
    if tok in r.stop_ids:
      self._finish(r, "stop")
      return
    take(r, tok)
    r.generated.append(tok)
    logprobs = None
    if r.params.logprobs:
      n = r.params.top_logprobs
      top = [
        (int(a), float(b))
        for a, b in zip(out.top_ids[step, row, :n], out.top_logprobs[step, row, :n], strict=True)
      ]
      logprobs = [(tok, float(out.logprobs[step, row]), top)]
    text, stopped = r.text.add(tok)
    if text or logprobs:
      r.emit(TokenEvent(text, [tok], logprobs))
    if stopped:
      self._finish(r, "stop")
    elif (
      len(r.generated) >= r.max_tokens
      or len(r.prompt_ids) + len(r.generated) >= self.runner.context
    ):
      self._finish(r, "length")

  def _finish(self, r: Request, reason: str) -> None:
    r.ended = True
    if r.slot is not None and self.slots[r.slot] is r:
      self.slots[r.slot] = None
      self.runner.free(r.slot)
    self.metrics.request_ended(reason, time.perf_counter() - r.arrived)
    rest = r.text.flush() if r.text is not None and reason != "cancelled" else ""
    r.emit(DoneEvent(reason, rest, len(r.prompt_ids), len(r.generated)))


@dataclasses.dataclass
class Started:
  """A program started on the device whose tokens are not handed out yet.

  Attributes:
    step: its samples (on the device).
    rows: (row of `step`, request) for each request it samples tokens for.
    at: when it was started (perf_counter seconds).
    steps: the steps it runs (a token each for every row).
    prompt: whether it is a prompt's last chunk (its token is the request's first).
  """

  step: Step
  rows: list[tuple[int, Request]]
  at: float
  steps: int = 1
  prompt: bool = False


__all__ = [
  "DoneEvent",
  "EngineDown",
  "ErrorEvent",
  "Event",
  "Request",
  "Scheduler",
  "Started",
  "TokenEvent",
]
