"""The decode loop on the device: tokens are sampled and fed back inside one XLA program.

`GGUFModel.stream` / `generate` used to run one jitted model call per token from a Python
loop, with a host round trip (argmax or sampling in eager JAX, `int(...)`, a new dispatch)
between steps. Here a chunk of up to `size` steps is one call: a `lax.while_loop` whose
body runs the model on the last token at position `pos + i`, samples the next token from
its logits, and stops early at a stop id; the KV cache is donated, so it is updated in
place. The model step is the same traced program as the one-token call, so its logits are
unchanged; sampling is the engine's chain (`q8rules.engine.chain.sample_rows`, on one row):
greedy is `argmax`, otherwise each sampled token splits the key once (`key, sub = split(key)`;
`categorical(sub, logits / temperature)`), as the host loop did, so a seed gives the same
tokens. The settings are arrays (one compiled loop for any of them).

    params = SamplingParams(temperature=0.7, top_p=0.9)
    settings, history = RowSettings.of([params]), history_of(prompt, history_length(params))
    tok, key, history = first_token(logits, params.key(), history, settings)  # after prefill
    loop = DecodeLoop(apply, size=16)
    toks, count, cache, tok, key, history = loop(variables, cache, tok, pos, key, history, n,
                                                 stops, settings)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.engine.chain import sample_rows
from q8rules.engine.sampling import HISTORY, RowSettings, SamplingParams

CHUNK = 16
"""Decode steps per device call in `GGUFModel.stream` (tokens are yielded a chunk at a time)."""

MAX_STOPS = 8
"""Stop ids are passed as a fixed-size array (padded with -1): up to this many per call."""


def history_length(params: SamplingParams) -> int:
  """The recent ids the decode keeps for `params`' penalties: `HISTORY`, or more when a
  penalty is on and `penalty_last_n` asks for more."""
  return max(HISTORY, params.penalty_last_n) if params.penalized else HISTORY


def _sample_one(logits, key, history, settings):
  """One row's token from its logits (vocab,): (token int32, key data (2,), history (H,))."""
  tok, key, history, *_ = sample_rows(logits[None], key[None], history[None], settings)
  return tok[0], key[0], history[0]


_first = jax.jit(_sample_one)


def first_token(
  logits: jax.Array, key: Any, history: Any, settings: RowSettings
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The token after the prompt, from the prefill's last logits (vocab,); the next key data
  (2,) uint32 and the history (H,) int32 with it (`key`: `SamplingParams.key()`; `history`:
  the prompt's, `history_of(prompt_ids, H)`; `settings`: the one row's)."""
  return _first(logits, jnp.asarray(key, jnp.uint32), jnp.asarray(history, jnp.int32), settings)


def stop_array(stop_ids: Sequence[int]) -> jax.Array:
  """`stop_ids` as an int32 (MAX_STOPS,) array padded with -1 (which no token equals)."""
  ids = list(dict.fromkeys(int(i) for i in stop_ids))
  if len(ids) > MAX_STOPS:
    raise ValueError(f"at most {MAX_STOPS} stop ids, got {len(ids)}")
  return jnp.asarray(ids + [-1] * (MAX_STOPS - len(ids)), jnp.int32)


class DecodeLoop:
  """Up to `size` decode steps in one jitted call (one compilation per `size` and history
  length; the step count `n`, positions, stop ids and sampling settings are traced).

  `apply(variables, tokens (1, 1), cache, pos) -> (logits (1, 1, vocab), cache)` is the
  model's one-token call; `context` (optional) wraps its tracing (e.g. shard_products).
  """

  def __init__(
    self, apply: Callable[..., Any], size: int = CHUNK, context: Callable[[], Any] | None = None
  ):
    self.size = size
    self._apply = apply
    self._context = context
    self._jit = jax.jit(self._loop, donate_argnums=(1,))

  def _loop(self, variables, cache, tok, pos, key, recent, n, stops, settings):
    toks = jnp.full((self.size,), -1, jnp.int32)

    def cond(state):
      i, _, _, _, _, _, stopped = state
      return (i < n) & ~stopped

    def body(state):
      i, toks, cache, tok, key, recent, _ = state
      logits, cache = self._apply(variables, tok.reshape(1, 1), cache, pos + i)
      tok, key, recent = _sample_one(logits[0, -1], key, recent, settings)
      toks = toks.at[i].set(tok)
      return i + 1, toks, cache, tok, key, recent, jnp.any(tok == stops)

    start = (jnp.int32(0), toks, cache, tok, key, recent, jnp.bool_(False))
    count, toks, cache, tok, key, recent, _ = jax.lax.while_loop(cond, body, start)
    return toks, count, cache, tok, key, recent

  def __call__(self, variables, cache, tok, pos, key, recent, n, stops, settings: RowSettings):
    """Run up to min(n, size) steps from token `tok` at position `pos` (stopping after a token
    in `stops`; `recent`: the last ids the penalties see; `settings`: the one row's): (tokens
    (size,) int32 with the first `count` valid, count, cache, the last token, key, recent)."""
    args = (
      variables,
      cache,
      tok,
      jnp.int32(pos),
      key,
      recent,
      jnp.int32(min(n, self.size)),
      stops,
      settings,
    )
    if self._context is None:
      return self._jit(*args)
    with self._context():
      return self._jit(*args)


def decode(
  loop: DecodeLoop,
  variables: Any,
  cache: Any,
  first: jax.Array,
  pos: int,
  key: Any,
  max_new_tokens: int,
  stop_ids: Sequence[int],
  settings: RowSettings,
  recent: jax.Array,
) -> Iterator[int]:
  """Yield `first`, then the tokens the loop samples after it (a chunk per device call, the
  next one dispatched before the current one's tokens are yielded, so the caller's work on
  them overlaps the device's), up to `max_new_tokens` in all or through the first token in
  `stop_ids`. `pos` is the
  position `first` goes to (the prompt's length); `recent`: the ids the penalties see, `first`
  included (`first_token`'s); `settings`: the one row's."""
  stops = stop_array(stop_ids)
  stop_set = set(int(i) for i in stop_ids)
  nxt = int(first)
  yield nxt
  done = 1
  if nxt in stop_set:
    return

  def launch(start: int, cache: Any, tok: Any, key: Any, recent: Any) -> Any:
    """The chunk whose first token is new token `start` (dispatched: JAX runs it while the
    caller handles the tokens of the chunk before), or None past `max_new_tokens`."""
    if start >= max_new_tokens:
      return None
    n = max_new_tokens - start
    return loop(variables, cache, tok, pos + start - 1, key, recent, n, stops, settings)

  pending = launch(done, cache, first, key, recent)
  while pending is not None:
    toks, count, cache, tok, key, recent = pending
    # the next chunk goes out before this one's tokens are read: if this one stops early
    # (a stop id, or the last tokens), the next is dropped unread
    pending = launch(done + loop.size, cache, tok, key, recent)
    count = int(count)
    for t in np.asarray(toks)[:count].tolist():  # a copy of the buffer, no new device op
      yield t
      done += 1
      if t in stop_set:
        return
    if count < loop.size:
      return


__all__ = ["CHUNK", "DecodeLoop", "decode", "first_token", "history_length", "stop_array"]
