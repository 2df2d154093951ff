"""The server's Prometheus metrics (`GET /metrics`), with `prometheus-client`, in a registry of
the server's own (several servers in one process each have theirs).

The engine's counters stay plain integers that its thread adds to (a token costs it no lock);
a collector reads them, and the engine's state, when `/metrics` is scraped:

  q8rules_requests_total{finish_reason}   requests ended: stop, length, cancelled, error,
                                          aborted (the engine stopped under them)
  q8rules_prompt_tokens_total             prompt tokens taken in
  q8rules_prompt_tokens_reused_total      of them, those a slot's cache held already (not
                                          prefilled again: the prefix cache)
  q8rules_generation_tokens_total         tokens generated
  q8rules_decode_steps_total              decode steps run
  q8rules_requests_running                requests holding a slot
  q8rules_requests_waiting                requests queued for a slot
  q8rules_slots                           slots of the batched KV cache
  q8rules_decode_tokens_per_second        tokens/s of the recent decode steps
  q8rules_engine_alive                    1 while the engine runs, else 0

The histograms are observed once per request (queue time, time to first token, duration) or
once per request and device program (inter-token latency):

  q8rules_queue_time_seconds              from the engine's queue to a slot
  q8rules_time_to_first_token_seconds     from the request's arrival to its first token
  q8rules_inter_token_latency_seconds     between a request's tokens (a program's tokens share
                                          its time evenly)
  q8rules_request_duration_seconds        from arrival to the last token (or the error)

and the API counts its error responses: q8rules_http_errors_total{status}.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "q8rules_"

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Seconds: inter-token latency, queue time and time to first token."""

DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
"""Seconds: a request's duration."""

HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
  "queue_time_seconds": ("Seconds from the engine's queue to a slot.", LATENCY_BUCKETS),
  "time_to_first_token_seconds": (
    "Seconds from a request's arrival to its first token.",
    LATENCY_BUCKETS,
  ),
  "inter_token_latency_seconds": ("Seconds between a request's tokens.", LATENCY_BUCKETS),
  "request_duration_seconds": ("Seconds from a request's arrival to its end.", DURATION_BUCKETS),
}
"""Each histogram's name (less `PREFIX`) -> its help text and buckets."""


@dataclasses.dataclass(frozen=True)
class EngineState:
  """The engine now, for the gauges."""

  running: int
  waiting: int
  slots: int
  alive: bool


class Metrics:
  """The counters the engine adds to, its histograms, and the registry that exposes them.

  Attributes:
    requests: requests ended, by finish reason.
    prompt_tokens, prompt_tokens_reused, generated_tokens, decode_steps: totals since start.
    recent_decode: the last decode programs' (end time, tokens, seconds).
    recent_durations: the last requests' durations (seconds).
    queue_time, time_to_first_token, inter_token_latency, request_duration: histograms.
    http_errors: error responses, by status (the API's).
    registry: what `/metrics` exposes.
  """

  def __init__(self) -> None:
    self.requests: collections.Counter = collections.Counter()
    self.prompt_tokens = 0
    self.prompt_tokens_reused = 0
    self.generated_tokens = 0
    self.decode_steps = 0
    self.recent_decode: collections.deque = collections.deque(maxlen=64)
    self.recent_durations: collections.deque = collections.deque(maxlen=64)
    self._state: Callable[[], EngineState] | None = None
    self.registry = CollectorRegistry()

    def histogram(name: str) -> Histogram:
      help, buckets = HISTOGRAMS[name]
      return Histogram(PREFIX + name, help, buckets=buckets, registry=self.registry)

    self.queue_time = histogram("queue_time_seconds")
    self.time_to_first_token = histogram("time_to_first_token_seconds")
    self.inter_token_latency = histogram("inter_token_latency_seconds")
    self.request_duration = histogram("request_duration_seconds")
    self.http_errors = Counter(
      PREFIX + "http_errors", "Error responses, by status.", ["status"], registry=self.registry
    )
    self.registry.register(_EngineCollector(self))

  def watch(self, state: Callable[[], EngineState]) -> None:
    """Read the gauges from `state()` at each scrape (the scheduler's)."""
    self._state = state

  def request_ended(self, reason: str, seconds: float) -> None:
    """Count a request that ended (`reason`) after `seconds` since its arrival."""
    self.requests[reason] += 1
    self.request_duration.observe(seconds)
    self.recent_durations.append(seconds)

  def typical_duration(self) -> float:
    """The mean duration of the recent requests (seconds; 0 before any)."""
    recent = list(self.recent_durations)
    return sum(recent) / len(recent) if recent else 0.0

  def decode_rate(self) -> float:
    """Tokens/s of the recent decode steps (each: (end time, tokens, seconds))."""
    steps = list(self.recent_decode)
    seconds = sum(s for _, _, s in steps)
    return sum(n for _, n, _ in steps) / seconds if seconds > 0 else 0.0

  def state(self) -> EngineState | None:
    return self._state() if self._state is not None else None

  def exposition(self) -> tuple[bytes, str]:
    """The Prometheus text of every metric, and its content type."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
  """The engine's plain counters and its state, as Prometheus metrics at scrape time."""

  def __init__(self, metrics: Metrics):
    self.metrics = metrics

  def describe(self) -> list[Metric]:
    return []  # unchecked: the names are fixed and the registry is the server's own

  def collect(self) -> Iterator[Metric]:
    m = self.metrics
    ended = CounterMetricFamily(
      PREFIX + "requests", "Requests ended, by how they ended.", labels=["finish_reason"]
    )
    for reason, n in sorted(m.requests.items()) or [("stop", 0)]:
      ended.add_metric([reason], n)
    yield ended
    for name, help, value in (
      ("prompt_tokens", "Prompt tokens taken in.", m.prompt_tokens),
      (
        "prompt_tokens_reused",
        "Prompt tokens a slot's cache held already.",
        m.prompt_tokens_reused,
      ),  # fmt: skip
      ("generation_tokens", "Tokens generated.", m.generated_tokens),
      ("decode_steps", "Decode steps run.", m.decode_steps),
    ):
      yield CounterMetricFamily(PREFIX + name, help, value=value)
    yield GaugeMetricFamily(
      PREFIX + "decode_tokens_per_second", "Tokens/s of the recent decode steps.",
      value=round(m.decode_rate(), 3),
    )  # fmt: skip
    state = m.state()
    if state is None:
      return
    for name, help, value in (
      ("requests_running", "Requests holding a slot.", state.running),
      ("requests_waiting", "Requests queued for a slot.", state.waiting),
      ("slots", "Slots of the batched KV cache.", state.slots),
      ("engine_alive", "1 while the engine runs, else 0.", int(state.alive)),
    ):
      yield GaugeMetricFamily(PREFIX + name, help, value=value)


__all__ = ["DURATION_BUCKETS", "HISTOGRAMS", "EngineState", "LATENCY_BUCKETS", "Metrics"]
