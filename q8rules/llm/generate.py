"""The decode loop on the device: tokens are sampled and fed back inside one XLA program.

`GGUFModel.stream` / `generate` used to run one jitted model call per token from a Python
loop, with a host round trip (argmax or sampling in eager JAX, `int(...)`, a new dispatch)
between steps. Here a chunk of up to `size` steps is one call: a `lax.while_loop` whose
body runs the model on the last token at position `pos + i`, samples the next token from
its logits, and stops early at a stop id; the KV cache is donated, so it is updated in
place. The model step is the same traced program as the one-token call, so its logits are
unchanged; sampling is too: greedy is `argmax`, otherwise each sampled token splits the key
once (`key, sub = split(key)`; `categorical(sub, logits / temperature)`), as the host loop
did, so a seed gives the same tokens.

    sampler = Sampler(temperature=0.7, seed=0)
    tok, key = first_token(logits[0, -1], key, sampler)      # after the prefill
    loop = DecodeLoop(apply, size=16)
    toks, count, cache, tok, key = loop(variables, cache, tok, pos, key, n, stops, sampler)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 16
"""Decode steps per device call in `GGUFModel.stream` (tokens are yielded a chunk at a time)."""

MAX_STOPS = 8
"""Stop ids are passed as a fixed-size array (padded with -1): up to this many per call."""


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Greedy (temperature 0) or sampling from softmax(logits / temperature)."""

  temperature: float = 0.0

  @property
  def greedy(self) -> bool:
    return not self.temperature > 0


def _sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool):
  """(token int32, key) from one position's logits (vocab,), as the host loop sampled."""
  if greedy:
    return jnp.argmax(logits).astype(jnp.int32), key
  key, sub = jax.random.split(key)
  return jax.random.categorical(sub, logits / temperature).astype(jnp.int32), key


@functools.partial(jax.jit, static_argnames=("greedy",))
def _first(logits: jax.Array, key: jax.Array, temperature: jax.Array, *, greedy: bool):
  return _sample(logits, key, temperature, greedy)


def first_token(logits: jax.Array, key: jax.Array, sampler: Sampler) -> tuple[jax.Array, Any]:
  """The token after the prompt, from the prefill's last logits (vocab,), and the next key."""
  return _first(logits, key, jnp.float32(sampler.temperature or 1.0), greedy=sampler.greedy)


def stop_array(stop_ids: Sequence[int]) -> jax.Array:
  """`stop_ids` as an int32 (MAX_STOPS,) array padded with -1 (which no token equals)."""
  ids = list(dict.fromkeys(int(i) for i in stop_ids))
  if len(ids) > MAX_STOPS:
    raise ValueError(f"at most {MAX_STOPS} stop ids, got {len(ids)}")
  return jnp.asarray(ids + [-1] * (MAX_STOPS - len(ids)), jnp.int32)


class DecodeLoop:
  """Up to `size` decode steps in one jitted call (one compilation per `size` and sampler
  kind; the step count `n`, positions, stop ids and temperature are traced).

  `apply(variables, tokens (1, 1), cache, pos) -> (logits (1, 1, vocab), cache)` is the
  model's one-token call; `context` (optional) wraps its tracing (e.g. shard_products).
  """

  def __init__(
    self, apply: Callable[..., Any], size: int = CHUNK, context: Callable[[], Any] | None = None
  ):
    self.size = size
    self._apply = apply
    self._context = context
    self._jit = jax.jit(self._loop, static_argnames=("greedy",), donate_argnums=(1,))

  def _loop(self, variables, cache, tok, pos, key, n, stops, temperature, *, greedy):
    toks = jnp.full((self.size,), -1, jnp.int32)

    def cond(state):
      i, _, _, _, _, stopped = state
      return (i < n) & ~stopped

    def body(state):
      i, toks, cache, tok, key, _ = state
      logits, cache = self._apply(variables, tok.reshape(1, 1), cache, pos + i)
      tok, key = _sample(logits[0, -1], key, temperature, greedy)
      toks = toks.at[i].set(tok)
      return i + 1, toks, cache, tok, key, jnp.any(tok == stops)

    start = (jnp.int32(0), toks, cache, tok, key, jnp.bool_(False))
    count, toks, cache, tok, key, _ = jax.lax.while_loop(cond, body, start)
    return toks, count, cache, tok, key

  def __call__(self, variables, cache, tok, pos, key, n, stops, sampler: Sampler):
    """Run up to min(n, size) steps from token `tok` at position `pos` (stopping after a token
    in `stops`): (tokens (size,) int32 with the first `count` valid, count, cache, the last
    token, key)."""
    args = (
      variables,
      cache,
      tok,
      jnp.int32(pos),
      key,
      jnp.int32(min(n, self.size)),
      stops,
      jnp.float32(sampler.temperature or 1.0),
    )
    if self._context is None:
      return self._jit(*args, greedy=sampler.greedy)
    with self._context():
      return self._jit(*args, greedy=sampler.greedy)


def decode(
  loop: DecodeLoop,
  variables: Any,
  cache: Any,
  first: jax.Array,
  pos: int,
  key: Any,
  max_new_tokens: int,
  stop_ids: Sequence[int],
  sampler: Sampler,
) -> Iterator[int]:
  """Yield `first`, then the tokens the loop samples after it (a chunk per device call),
  up to `max_new_tokens` in all or through the first token in `stop_ids`. `pos` is the
  position `first` goes to (the prompt's length)."""
  stops = stop_array(stop_ids)
  stop_set = set(int(i) for i in stop_ids)
  tok = first
  nxt = int(first)
  yield nxt
  done = 1
  if nxt in stop_set:
    return
  while done < max_new_tokens:
    toks, count, cache, tok, key = loop(
      variables, cache, tok, pos + done - 1, key, max_new_tokens - done, stops, sampler
    )
    for t in np.asarray(toks[: int(count)]).tolist():
      yield t
      done += 1
      if t in stop_set:
        return


__all__ = ["CHUNK", "DecodeLoop", "Sampler", "decode", "first_token", "stop_array"]
