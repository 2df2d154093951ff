"""Sampling settings: one request's (`SamplingParams`) and a batch's, one entry per row
(`RowSettings`), for the chain `q8rules.engine.chain.sample_rows` runs on the device.

The chain is llama.cpp's: `logit_bias` added to the logits, then penalties over the row's last
`penalty_last_n` ids (prompt included: `repeat_penalty` divides positive logits and multiplies
negative ones, then `frequency_penalty * count + presence_penalty * (count > 0)` is
subtracted), then top-k, top-p, min-p, temperature and a draw. Greedy (temperature 0) is the
argmax after the bias and the penalties.

Every setting is an array with one entry per row, so one compiled program serves any mix of
requests (`q8rules serve`'s slots, `q8rules run`'s one row), and each row's token depends only
on its own logits, settings, key and history.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

HISTORY = 64
"""The recent ids a row keeps for the penalties by default (`penalty_last_n` is at most the
history's length: `q8rules serve` keeps this many, `q8rules run` more when asked)."""

MAX_TOP_LOGPROBS = 20
"""`top_logprobs` is at most this (OpenAI's limit)."""

MAX_LOGIT_BIAS = 300
"""A request's `logit_bias` holds at most this many ids (each row keeps this many slots)."""

SEED_MODULUS = 1 << 32
"""A seed is kept modulo this (its low 32 bits, as llama.cpp's uint32 seed; `jax.random.key`
gives the same key for a seed and its low 32 bits)."""


def chain_errors(
  temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float
) -> list[str]:
  """A message for each setting of the chain outside its range, in this order (empty: all
  fit): temperature >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1], repeat_penalty > 0."""
  checks = [
    (temperature >= 0, "temperature must be >= 0"),
    (top_k >= 0, "top_k must be >= 0"),
    (0 < top_p <= 1, "top_p must be in (0, 1]"),
    (0 <= min_p <= 1, "min_p must be in [0, 1]"),
    (repeat_penalty > 0, "repeat_penalty must be > 0"),
  ]
  return [message for ok, message in checks if not ok]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling settings; the defaults are OpenAI's (temperature 1, nothing else).

  Attributes:
    temperature: 0 (greedy: the argmax) or > 0 (a draw from softmax(l / temperature)).
    top_p: in (0, 1]: keep the most likely ids up to this probability mass; 1 is off.
    top_k: keep the k most likely ids; 0 is off.
    min_p: in [0, 1]: keep the ids at least this fraction of the most likely one's
      probability; 0 is off.
    repeat_penalty: > 0; 1 is off (llama.cpp's).
    frequency_penalty, presence_penalty: in [-2, 2]; 0 is off (OpenAI's).
    penalty_last_n: how many of the last ids (prompt included) the penalties count (at most
      the history the decode keeps: `HISTORY` in `q8rules serve`).
    seed: the draws' seed, in [0, `SEED_MODULUS`).
    logprobs: whether the chosen tokens' log-probabilities are returned.
    top_logprobs: how many alternatives per token (0..`MAX_TOP_LOGPROBS`).
    logit_bias: ((token id, bias), ...), at most `MAX_LOGIT_BIAS`: each bias is added to its
      id's logit before the rest of the chain (the log-probabilities stay the model's).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  repeat_penalty: float = 1.0
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  penalty_last_n: int = HISTORY
  seed: int = 0
  logprobs: bool = False
  top_logprobs: int = 0
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self) -> None:
    errors = chain_errors(self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty)
    checks = [
      (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
      (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
      (self.penalty_last_n >= 0, "penalty_last_n must be >= 0"),
      (
        0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
        f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
      ),
      (0 <= self.seed < SEED_MODULUS, f"seed must be in [0, {SEED_MODULUS})"),
      (len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias holds at most {MAX_LOGIT_BIAS} ids"),
      (all(i >= 0 for i, _ in self.logit_bias), "logit_bias ids must be >= 0"),
    ]
    errors += [message for ok, message in checks if not ok]
    if errors:
      raise ValueError(errors[0])

  @property
  def greedy(self) -> bool:
    return not self.temperature > 0

  @property
  def penalized(self) -> bool:
    """Whether a penalty is on (the history matters)."""
    return (
      self.repeat_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
    ) and self.penalty_last_n > 0

  @property
  def plain_argmax(self) -> bool:
    """Whether the chain reduces to the argmax of the logits: greedy, with no bias, no penalty
    and no log-probabilities asked for (a runner built `greedy_only` takes these alone)."""
    return self.greedy and not self.penalized and not self.logit_bias and not self.logprobs

  def key(self) -> np.ndarray:
    """The request's first key: `jax.random.key(seed)`'s data, uint32 (2,)."""
    return np.asarray(jax.random.key_data(jax.random.key(self.seed)), np.uint32)


@dataclasses.dataclass(frozen=True)
class RowSettings:
  """The batch's settings, one entry per row (host arrays the runner passes each step).

  Attributes:
    temperature, top_p, min_p, repeat_penalty, frequency_penalty, presence_penalty: (P,)
      float32.
    top_k, penalty_last_n: (P,) int32.
    logprobs: (P,) bool, whether a row wants log-probabilities.
    bias_ids: (P, MAX_LOGIT_BIAS) int32, each row's `logit_bias` ids (-1: none).
    bias: (P, MAX_LOGIT_BIAS) float32, their biases (0: none).
  """

  temperature: np.ndarray
  top_p: np.ndarray
  min_p: np.ndarray
  repeat_penalty: np.ndarray
  frequency_penalty: np.ndarray
  presence_penalty: np.ndarray
  top_k: np.ndarray
  penalty_last_n: np.ndarray
  logprobs: np.ndarray
  bias_ids: np.ndarray
  bias: np.ndarray

  FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
  )

  @classmethod
  def empty(cls, rows: int) -> RowSettings:
    """`rows` greedy rows with every step off."""
    return cls.of([SamplingParams(temperature=0.0)] * rows)

  @classmethod
  def of(cls, params: list[SamplingParams]) -> RowSettings:
    floats = {f: np.asarray([getattr(p, f) for p in params], np.float32) for f in cls.FLOATS}
    bias_ids = np.full((len(params), MAX_LOGIT_BIAS), -1, np.int32)
    bias = np.zeros((len(params), MAX_LOGIT_BIAS), np.float32)
    for row, p in enumerate(params):
      _bias_row(p, bias_ids[row], bias[row])
    return cls(
      **floats,
      top_k=np.asarray([p.top_k for p in params], np.int32),
      penalty_last_n=np.asarray([p.penalty_last_n for p in params], np.int32),
      logprobs=np.asarray([p.logprobs for p in params], bool),
      bias_ids=bias_ids,
      bias=bias,
    )

  def set(self, row: int, p: SamplingParams) -> None:
    """Row `row` takes `p`'s settings (in place)."""
    for f in self.FLOATS:
      getattr(self, f)[row] = getattr(p, f)
    self.top_k[row] = p.top_k
    self.penalty_last_n[row] = p.penalty_last_n
    self.logprobs[row] = p.logprobs
    _bias_row(p, self.bias_ids[row], self.bias[row])

  def arrays(self) -> tuple[np.ndarray, ...]:
    """The per-row scalars: the `FLOATS`, then top_k and penalty_last_n."""
    return (*(getattr(self, f) for f in self.FLOATS), self.top_k, self.penalty_last_n)


def _bias_row(p: SamplingParams, ids: np.ndarray, bias: np.ndarray) -> None:
  """Write `p.logit_bias` into one row's `bias_ids` and `bias` (in place), the rest empty."""
  ids.fill(-1)
  bias.fill(0)
  for j, (i, b) in enumerate(p.logit_bias):
    ids[j], bias[j] = i, b


jax.tree_util.register_pytree_node(
  RowSettings,
  lambda s: ((*s.arrays(), s.logprobs, s.bias_ids, s.bias), None),
  lambda _, xs: RowSettings(
    *xs[:6], top_k=xs[6], penalty_last_n=xs[7], logprobs=xs[8], bias_ids=xs[9], bias=xs[10]
  ),
)


def history_of(ids: list[int] | np.ndarray, length: int = HISTORY) -> np.ndarray:
  """The last `length` of `ids` as int32 (length,), padded in front with -1."""
  out = np.full((length,), -1, np.int32)
  tail = np.asarray(ids, np.int32).reshape(-1)[-length:] if length else ()
  if len(tail):
    out[-len(tail) :] = tail
  return out


__all__ = [
  "HISTORY",
  "MAX_LOGIT_BIAS",
  "MAX_TOP_LOGPROBS",
  "SEED_MODULUS",
  "RowSettings",
  "SamplingParams",
  "chain_errors",
  "history_of",
]
