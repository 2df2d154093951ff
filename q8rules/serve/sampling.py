"""Sampling per request, for a batch of rows that each follow their own settings.

`SamplingParams` is one request's settings (OpenAI's and llama.cpp's names). `sample_rows` is
the traced step the runner runs on the device: every setting is an array with one entry per
row, so one compiled program serves any mix of requests, and each row's token depends only on
its own logits, settings, key and history (never on the other rows or its row number).

The chain is llama.cpp's: `logit_bias` added to the logits, then penalties over the row's last
`penalty_last_n` ids (prompt included: `repeat_penalty` divides positive logits and multiplies
negative ones, then `frequency_penalty * count + presence_penalty * (count > 0)` is
subtracted), then top-k, top-p, min-p, temperature and a draw. Greedy (temperature 0) is the
argmax after the bias and the penalties. A
sampled row splits its key once per token (`key, sub = split(key)`), the key starting from the
request's seed, so a seed gives the same tokens at any slot and beside any requests.

Log-probabilities are those of the model's distribution (log-softmax of the raw logits, before
the bias, the penalties and the filters), as OpenAI's API reports them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.llm.sampling import chain_errors, first_max

HISTORY = 64
"""The most recent ids a row keeps for the penalties (`penalty_last_n` is at most this)."""

MAX_TOP_LOGPROBS = 20
"""`top_logprobs` is at most this (OpenAI's limit)."""

MAX_LOGIT_BIAS = 300
"""A request's `logit_bias` holds at most this many ids (each row keeps this many slots)."""

SEED_MODULUS = 1 << 32
"""A seed is kept modulo this (its low 32 bits, as llama.cpp's uint32 seed)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling settings; the defaults are OpenAI's (temperature 1, nothing else).

  Attributes:
    temperature: 0 (greedy) or > 0.
    top_p: in (0, 1]; 1 is off.
    top_k: 0 is off.
    min_p: in [0, 1]; 0 is off.
    repeat_penalty: > 0; 1 is off (llama.cpp's).
    frequency_penalty, presence_penalty: in [-2, 2]; 0 is off (OpenAI's).
    penalty_last_n: how many of the last ids (prompt included) the penalties count, at most
      `HISTORY`.
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
      (0 <= self.penalty_last_n <= HISTORY, f"penalty_last_n must be in [0, {HISTORY}]"),
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
    """The settings in `sample_rows`' order."""
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


def _biased(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
  """One row's logits (V,) with its biases (MAX_LOGIT_BIAS,) added at `ids` (-1: none)."""
  vocab = logits.shape[0]
  return logits.at[jnp.where(ids >= 0, ids, vocab)].add(bias, mode="drop")


def _penalized(logits: jax.Array, history: jax.Array, s: tuple) -> jax.Array:
  """One row's logits (V,) float32 after llama.cpp's penalties over its history (HISTORY,)
  int32 (newest last, -1 for none). With every penalty off (repeat 1, frequency and presence 0)
  it returns the logits unchanged, bit for bit (x / 1, x * 1 and x - 0 are x)."""
  _, _, _, repeat, frequency, presence, _, last_n = s
  vocab = logits.shape[0]
  counted = (history >= 0) & (jnp.arange(HISTORY) >= HISTORY - last_n)
  counts = jnp.zeros((vocab,), jnp.int32).at[jnp.where(counted, history, vocab)]
  counts = counts.add(1, mode="drop")
  seen = counts > 0
  x = jnp.where(seen, jnp.where(logits > 0, logits / repeat, logits * repeat), logits)
  return jnp.where(seen, x - counts * frequency - presence, x)


def _draw(x: jax.Array, key: jax.Array, s: tuple) -> tuple[jax.Array, jax.Array]:
  """One row's draw from its penalized logits (V,): (token int32, next key data uint32 (2,)):
  top-k, top-p, min-p and temperature over the ids sorted by logit (ties by id)."""
  temperature, top_p, min_p, _, _, _, top_k, _ = s
  order = jnp.argsort(-x, stable=True)
  ranked = x[order]
  rank = jnp.arange(x.shape[0])
  ranked = jnp.where((top_k <= 0) | (rank < top_k), ranked, -jnp.inf)
  p = jax.nn.softmax(ranked)
  before = jnp.cumsum(p) - p
  ranked = jnp.where((top_p >= 1) | (before < top_p), ranked, -jnp.inf)
  p = jax.nn.softmax(ranked)
  ranked = jnp.where(p >= min_p * p.max(), ranked, -jnp.inf)
  k, sub = jax.random.split(jax.random.wrap_key_data(key))
  pick = jax.random.categorical(sub, ranked / jnp.maximum(temperature, 1e-6))
  return order[pick].astype(jnp.int32), jax.random.key_data(k)


def sample_rows(
  logits: jax.Array, keys: jax.Array, history: jax.Array, settings: RowSettings
) -> tuple[jax.Array, ...]:
  """The next token of every row (traced).

  Args:
    logits: (P, V) float32, each row's last position.
    keys: (P, 2) uint32, each row's key data.
    history: (P, HISTORY) int32, each row's last ids, newest last (-1 for none).
    settings: the rows' settings (`RowSettings`, as device or host arrays).

  Returns:
    tokens (P,) int32; keys (P, 2) uint32 (a sampled row's split once); history (P, HISTORY)
    with the tokens appended; the tokens' log-probabilities (P,) float32; the top
    `MAX_TOP_LOGPROBS` ids (P, K) int32 and their log-probabilities (P, K) float32 (zeros
    when no row wants log-probabilities).
  """
  s = settings.arrays()
  x = logits.astype(jnp.float32)
  x = jax.lax.cond(  # skipped when no row has a bias: the same bits
    jnp.any(settings.bias != 0),
    lambda: jax.vmap(_biased)(x, settings.bias_ids, settings.bias),
    lambda: x,
  )
  penalties = (
    (settings.repeat_penalty != 1)
    | (settings.frequency_penalty != 0)
    | (settings.presence_penalty != 0)
  )
  x = jax.lax.cond(  # skipped when no row has a penalty: the same bits (`_penalized`)
    jnp.any(penalties),
    lambda: jax.vmap(lambda x, h, *s: _penalized(x, h, s))(x, history, *s),
    lambda: x,
  )
  greedy = first_max(x)

  def sampled() -> tuple[jax.Array, jax.Array]:
    tok, nxt = jax.vmap(lambda x, k, *s: _draw(x, k, s))(x, keys, *s)
    is_greedy = settings.temperature <= 0
    return jnp.where(is_greedy, greedy, tok), jnp.where(is_greedy[:, None], keys, nxt)

  tokens, keys = jax.lax.cond(
    jnp.any(settings.temperature > 0), sampled, lambda: (greedy, jnp.asarray(keys))
  )
  history = jnp.concatenate([history[:, 1:], tokens[:, None]], axis=1)
  k = min(MAX_TOP_LOGPROBS, logits.shape[1])

  def with_logprobs():
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_ids.astype(jnp.int32), top_lp

  def without():
    b = logits.shape[0]
    return (
      jnp.zeros((b,), jnp.float32),
      jnp.zeros((b, k), jnp.int32),
      jnp.zeros((b, k), jnp.float32),
    )

  chosen, top_ids, top_lp = jax.lax.cond(jnp.any(settings.logprobs), with_logprobs, without)
  return tokens, keys, history, chosen, top_ids, top_lp


def history_of(ids: list[int]) -> np.ndarray:
  """The last `HISTORY` of `ids` as int32 (HISTORY,), padded in front with -1."""
  out = np.full((HISTORY,), -1, np.int32)
  tail = np.asarray(ids[-HISTORY:], np.int32)
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
  "first_max",
  "history_of",
  "sample_rows",
]
