"""The sampler chain, traced: the next token of every row of a batch from its logits, each row
by its own settings (`q8rules.engine.sampling.RowSettings`), key and history.

`sample_rows` runs llama.cpp's chain: the logit bias, the penalties, then for a sampled row
(temperature > 0) top-k, top-p, min-p, the temperature and a draw; for a greedy row the argmax
after the bias and the penalties. Each row's token is the same bits whatever the other rows
ask for: a step skipped for the whole batch (no row has a bias, a penalty, a top-p ...) is one
whose result would have left every row as it was.

The vocabulary is never sorted:

  top-k <= TOP_K_MAX   `lax.top_k` takes the TOP_K_MAX largest (descending, the lower id first
                       among equal ones: a stable sort's order); the row's k of them are kept,
                       and top-p (a cumulative sum), min-p and the draw work on those;
  otherwise            the masks are found on the whole vocabulary in id order: the cut of
                       top-k (k > TOP_K_MAX) and of top-p are each a threshold value found by
                       bisection over the float32 order (32 passes of O(V): a count, or a
                       masked sum of the probabilities, above the candidate threshold), ties at
                       the threshold kept by id (the lower first, as llama.cpp's stable sort);
                       min-p is a mask; the draw is over the whole vocabulary.

A sampled row splits its key once per token (`key, sub = split(key)`) and draws
`categorical(sub, kept / temperature)`; the noise of a draw over n values is the first n of a
longer one, so a top-k draw over TOP_K_MAX candidates with the row's k kept is the draw over k.

Log-probabilities are those of the model's distribution (log-softmax of the raw logits, before
the bias, the penalties and the filters), as OpenAI's API reports them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from q8rules.engine.bitmask import apply_bitmask
from q8rules.engine.sampling import MAX_TOP_LOGPROBS, RowSettings

TOP_K_MAX = 128
"""A top-k up to this picks its candidates with `lax.top_k(x, TOP_K_MAX)`; a larger one is a
threshold over the vocabulary."""

BISECTION_PASSES = 32
"""The passes of a threshold's bisection: one per bit of a float32's order key."""


def first_max(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` as int32 (each row's first index of its largest value; of its
  first NaN where it has one) in plain reductions, which XLA:CPU vectorizes: a max, then the
  least index that holds it. XLA:CPU runs argmax's reduction of (value, index) pairs an element
  at a time: 1.1-2 ms a decode step over Gemma's 262,144 logits, against 0.2 ms."""
  top = jnp.max(x, axis=-1, keepdims=True)
  nan = jnp.isnan(x)
  hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _biased(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
  """One row's logits (V,) with its biases (MAX_LOGIT_BIAS,) added at `ids` (-1: none)."""
  vocab = logits.shape[0]
  return logits.at[jnp.where(ids >= 0, ids, vocab)].add(bias, mode="drop")


def _penalized(logits: jax.Array, history: jax.Array, s: tuple) -> jax.Array:
  """One row's logits (V,) float32 after llama.cpp's penalties over its history (H,) int32
  (newest last, -1 for none). With every penalty off (repeat 1, frequency and presence 0)
  it returns the logits unchanged, bit for bit (x / 1, x * 1 and x - 0 are x)."""
  _, _, _, repeat, frequency, presence, _, last_n = s
  vocab, length = logits.shape[0], history.shape[0]
  counted = (history >= 0) & (jnp.arange(length) >= length - last_n)
  counts = jnp.zeros((vocab,), jnp.int32).at[jnp.where(counted, history, vocab)]
  counts = counts.add(1, mode="drop")
  seen = counts > 0
  x = jnp.where(seen, jnp.where(logits > 0, logits / repeat, logits * repeat), logits)
  return jnp.where(seen, x - counts * frequency - presence, x)


def _order_key(x: jax.Array) -> jax.Array:
  """uint32 keys in the float order of `x` (a < b exactly when key(a) < key(b); -0 as +0)."""
  bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)  # -0.0 + 0.0 is +0.0
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _least_key(holds: Callable[[jax.Array], jax.Array], rows: int) -> jax.Array:
  """Each row's least uint32 t where `holds(t)` (t (P,) -> (P,) bool, false below some t and
  true from there on, true at the largest key), by bisection."""

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = holds(mid)
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  lo = jnp.zeros((rows,), jnp.uint32)
  hi = jnp.full((rows,), 0xFFFFFFFF, jnp.uint32)
  return jax.lax.fori_loop(0, BISECTION_PASSES, step, (lo, hi))[1]


def _first_ties(at: jax.Array, room: jax.Array) -> jax.Array:
  """`at` (P, V) bool with each row's set entries after its first `room` (P,) (by id) unset;
  the cumulative count runs only when some row has more than its room."""
  return jax.lax.cond(
    jnp.any(jnp.sum(at, axis=-1) > room),
    lambda: at & (jnp.cumsum(at, axis=-1) <= room[:, None]),
    lambda: at,
  )


def _top_k_mask(x: jax.Array, top_k: jax.Array) -> jax.Array:
  """`x` (P, V) with all but each row's `top_k` largest at -inf (ties by id); rows with top_k 0
  or <= TOP_K_MAX (cut elsewhere) unchanged."""
  key = _order_key(x)
  k = top_k[:, None]
  v = _least_key(lambda t: jnp.sum(key > t[:, None], axis=-1) < top_k, x.shape[0])[:, None]
  above = jnp.sum(key > v, axis=-1, keepdims=True)
  keep = (key > v) | _first_ties(key == v, (k - above)[:, 0])
  return jnp.where((k <= TOP_K_MAX) | keep, x, -jnp.inf)


def _top_p_mask(x: jax.Array, top_p: jax.Array) -> jax.Array:
  """`x` (P, V) cut to each row's smallest set of most likely ids (by logit, ties by id) whose
  probability (softmax of what is left) reaches `top_p` (P,) (at least one id); rows with top_p
  1 unchanged. The threshold value: the least logit with less than top_p ahead of it."""
  p = jax.nn.softmax(x, axis=-1)
  key = _order_key(x)
  q = top_p[:, None]

  def ahead(t: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(key > t[:, None], p, 0.0), axis=-1)

  v = _least_key(lambda t: ahead(t) < top_p, x.shape[0])
  at = key == v[:, None]
  mass = ahead(v)[:, None]
  each = jnp.max(jnp.where(at, p, 0.0), axis=-1, keepdims=True)  # the ties' probability
  room = jnp.ceil((q - mass) / jnp.where(each > 0, each, 1.0))  # ties kept while mass < top_p
  room = jnp.where(each > 0, room, x.shape[1]).astype(jnp.int32)[:, 0]
  keep = (key > v[:, None]) | _first_ties(at, jnp.maximum(room, 1))
  return jnp.where((q >= 1) | keep, x, -jnp.inf)


def _min_p_mask(x: jax.Array, min_p: jax.Array) -> jax.Array:
  """`x` (P, n) with the ids below `min_p` (P,) times the row's largest probability at -inf."""
  p = jax.nn.softmax(x, axis=-1)
  return jnp.where(p >= min_p[:, None] * jnp.max(p, axis=-1, keepdims=True), x, -jnp.inf)


def _draw(subs: jax.Array, x: jax.Array, temperature: jax.Array) -> jax.Array:
  """Each row's categorical draw (P,) int32 from `x` (P, n) / temperature with its subkey."""
  scaled = x / jnp.maximum(temperature, 1e-6)[:, None]
  return jax.vmap(jax.random.categorical)(subs, scaled).astype(jnp.int32)


def _top_k_candidates(x: jax.Array, s: RowSettings) -> tuple[jax.Array, jax.Array]:
  """The rows' TOP_K_MAX largest logits, descending (ties by id), with all but each row's top-k
  (k <= TOP_K_MAX), top-p and min-p at -inf (P, K) float32, and their ids (P, K) int32."""
  ranked, ids = jax.lax.top_k(x, min(TOP_K_MAX, x.shape[1]))
  ranked = jnp.where(jnp.arange(ranked.shape[1]) < s.top_k[:, None], ranked, -jnp.inf)
  p = jax.nn.softmax(ranked, axis=-1)
  before = jnp.cumsum(p, axis=-1) - p  # the mass ahead of each id: keep it while that is < top_p
  ranked = jnp.where((s.top_p[:, None] >= 1) | (before < s.top_p[:, None]), ranked, -jnp.inf)
  return _min_p_mask(ranked, s.min_p), ids.astype(jnp.int32)


def _vocabulary_candidates(x: jax.Array, s: RowSettings, rows: jax.Array) -> jax.Array:
  """`x` (P, V) with top-k (k > TOP_K_MAX), top-p and min-p as masks (-inf), each skipped when
  none of `rows` (P,) bool has it on."""
  x = jax.lax.cond(
    jnp.any(rows & (s.top_k > TOP_K_MAX)), lambda: _top_k_mask(x, s.top_k), lambda: x
  )
  x = jax.lax.cond(jnp.any(rows & (s.top_p < 1)), lambda: _top_p_mask(x, s.top_p), lambda: x)
  return jax.lax.cond(jnp.any(rows & (s.min_p > 0)), lambda: _min_p_mask(x, s.min_p), lambda: x)


def _small_top_k(s: RowSettings) -> jax.Array:
  """(P,) bool: the rows whose top-k picks its candidates with `lax.top_k`."""
  return (s.top_k > 0) & (s.top_k <= TOP_K_MAX)


def candidates(logits: jax.Array, history: jax.Array, settings: RowSettings) -> jax.Array:
  """What each row draws from (P, V) float32, in id order: its biased and penalized logits
  with what top-k, top-p and min-p remove at -inf (the chain's filters, whatever the row's
  temperature)."""
  x = filtered_logits(logits, history, settings)
  small = _small_top_k(settings)
  ranked, ids = _top_k_candidates(x, settings)
  by_k = jax.vmap(lambda r, i: jnp.full(x.shape[1:], -jnp.inf).at[i].set(r))(ranked, ids)
  return jnp.where(small[:, None], by_k, _vocabulary_candidates(x, settings, ~small))


def filtered_logits(logits: jax.Array, history: jax.Array, settings: RowSettings) -> jax.Array:
  """The logits (P, V) float32 after the bias and the penalties: what the greedy pick and the
  filters see."""
  x = logits.astype(jnp.float32)
  x = jax.lax.cond(  # skipped when no row has a bias: the same bits
    jnp.any(settings.bias != 0),
    lambda: jax.vmap(_biased)(x, settings.bias_ids, settings.bias),
    lambda: x,
  )
  s = settings.arrays()
  penalties = (
    (settings.repeat_penalty != 1)
    | (settings.frequency_penalty != 0)
    | (settings.presence_penalty != 0)
  )
  return jax.lax.cond(  # skipped when no row has a penalty: the same bits (`_penalized`)
    jnp.any(penalties),
    lambda: jax.vmap(lambda x, h, *s: _penalized(x, h, s))(x, history, *s),
    lambda: x,
  )


def draw_rows(x: jax.Array, keys: jax.Array, settings: RowSettings) -> tuple[jax.Array, jax.Array]:
  """Each sampled row's draw from its biased and penalized logits `x` (P, V) float32, and its
  key data split once (P, 2) uint32; a greedy row's argmax and its key unchanged."""
  s = settings

  def sampled() -> tuple[jax.Array, jax.Array]:
    greedy = jax.lax.cond(  # the argmax only when some row is greedy
      jnp.any(s.temperature <= 0), lambda: first_max(x), lambda: jnp.zeros(x.shape[:1], jnp.int32)
    )
    split = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k)))(keys)
    nxt, subs = jax.random.key_data(split[:, 0]), split[:, 1]
    want = s.temperature > 0
    small = _small_top_k(s)
    none = jnp.zeros(x.shape[:1], jnp.int32)

    def by_k() -> jax.Array:
      ranked, ids = _top_k_candidates(x, s)
      pick = _draw(subs, ranked, s.temperature)
      return jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]

    def by_v() -> jax.Array:
      return _draw(subs, _vocabulary_candidates(x, s, want & ~small), s.temperature)

    by_k = jax.lax.cond(jnp.any(want & small), by_k, lambda: none)
    by_v = jax.lax.cond(jnp.any(want & ~small), by_v, lambda: none)
    tok = jnp.where(small, by_k, by_v)
    return jnp.where(want, tok, greedy), jnp.where(want[:, None], nxt, keys)

  return jax.lax.cond(
    jnp.any(settings.temperature > 0), sampled, lambda: (first_max(x), jnp.asarray(keys))
  )


def sample_rows(
  logits: jax.Array,
  keys: jax.Array,
  history: jax.Array,
  settings: RowSettings,
  allowed: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """The next token of every row (traced).

  Args:
    logits: (P, V) float32, each row's last position.
    keys: (P, 2) uint32, each row's key data.
    history: (P, H) int32, each row's last ids, newest last (-1 for none); H >= every row's
      `penalty_last_n`.
    settings: the rows' settings (`RowSettings`, as device or host arrays).
    allowed: (P, ceil(V / 32)) int32, each row's allowed tokens as a packed bitmask
      (`q8rules.engine.bitmask`: a grammar's next tokens; all bits set for a free row), or
      None (every token). A disallowed token's logit is -inf before the chain.

  Returns:
    tokens (P,) int32; keys (P, 2) uint32 (a sampled row's split once); history (P, H)
    with the tokens appended; the tokens' log-probabilities (P,) float32; the top
    `MAX_TOP_LOGPROBS` ids (P, K) int32 and their log-probabilities (P, K) float32 (zeros
    when no row wants log-probabilities).
  """
  masked = logits if allowed is None else apply_bitmask(logits, allowed)
  x = filtered_logits(masked, history, settings)
  tokens, keys = draw_rows(x, keys, settings)
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


def greedy_rows(
  logits: jax.Array,
  keys: jax.Array,
  history: jax.Array,
  settings: RowSettings | None = None,
  allowed: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """`sample_rows` for rows that are all plain argmax (`SamplingParams.plain_argmax`: greedy,
  no bias, no penalty, no log-probabilities): the same tokens, bit for bit (the argmax of the
  same float32 logits, masked alike), and outputs of the same shapes (keys unchanged, the
  history appended, log-probabilities zeros); `settings` is not read. Its program is a small
  fraction of the whole chain's to compile."""
  masked = logits if allowed is None else apply_bitmask(logits, allowed)
  tokens = first_max(masked.astype(jnp.float32))
  history = jnp.concatenate([history[:, 1:], tokens[:, None]], axis=1)
  b, k = logits.shape[0], min(MAX_TOP_LOGPROBS, logits.shape[1])
  zeros = (
    jnp.zeros((b,), jnp.float32),
    jnp.zeros((b, k), jnp.int32),
    jnp.zeros((b, k), jnp.float32),
  )
  return (tokens, jnp.asarray(keys), history, *zeros)


__all__ = [
  "TOP_K_MAX",
  "candidates",
  "draw_rows",
  "filtered_logits",
  "first_max",
  "greedy_rows",
  "sample_rows",
]
