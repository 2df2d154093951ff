"""The batched KV cache and the two device programs a server runs on it: a prompt chunk into one
slot, and one decode step for every slot.

The cache is the decoder's own (`q8rules.models.init_cache`) with `slots` rows: row i is slot
i, `context` positions long. A running request owns a slot from its first prompt chunk to its
last token.

  runner = BatchRunner(model, slots=4, context=2048)
  out = runner.prefill(slot, ids[0:64], pos=0, ...)       # a chunk: (1, T) at positions [0, 64)
  out = runner.decode(tokens, positions, keys, history, settings)   # every row one token

A decode step runs the decoder on tokens (P, 1) with one position per row (the decoder's
per-row positions: each row writes, masks and attends at its own position), so every weight is
read once for all P rows, and a row's logits are the same computation whatever the other rows
hold: its product rows are computed on their own, its attention runs per row, its sampling
(`q8rules.serve.sampling`) uses its own settings and key. Rows that are not decoding (free, or
between prompt chunks) still run, on a dummy token at their next position: what it writes there
is overwritten before it is ever visible (the next chunk or token writes that position first;
in a sliding-window ring, that slot holds a position outside every later token's window).

A prompt chunk runs the decoder on that slot's row alone (batch 1, copied out of the cache and
back), T tokens at one position; the chunk sizes depend on the prompt's length only
(`chunks`), so a request's prefill is the same computation in any slot beside any others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.models.attention import init_cache
from q8rules.serve.sampling import HISTORY, MAX_TOP_LOGPROBS, RowSettings, sample_rows

CHUNK = 128
"""The longest prompt chunk prefilled between two decode steps (a power of 2)."""


def chunks(n: int, chunk: int = CHUNK) -> list[int]:
  """The chunk lengths a prompt of `n` tokens is prefilled in: `chunk`s, then the rest as
  descending powers of 2 (so at most log2(chunk) + 1 shapes are compiled, and no chunk is
  padded)."""
  out = [chunk] * (n // chunk)
  rest = n % chunk
  bit = chunk
  while rest:
    bit //= 2
    if rest >= bit:
      out.append(bit)
      rest -= bit
  return out


@dataclasses.dataclass(frozen=True)
class Sampled:
  """What a device program returns per row, on the host.

  Attributes:
    tokens: (P,) int32, the next token of each row.
    keys: (P, 2) uint32, each row's next key data.
    history: (P, HISTORY) int32, each row's last ids with the new token.
    logprobs: (P,) float32, the tokens' log-probabilities (0 when no row asked).
    top_ids, top_logprobs: (P, MAX_TOP_LOGPROBS) int32 / float32, the most likely ids.
  """

  tokens: np.ndarray
  keys: np.ndarray
  history: np.ndarray
  logprobs: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray

  @classmethod
  def of(cls, out: tuple[jax.Array, ...]) -> Sampled:
    return cls(*(np.asarray(a) for a in out))


class BatchRunner:
  """A model's batched KV cache (`slots` rows of `context` positions) and its programs.

  Args:
    model: a `GGUFModel` (its module and params; one device, no mesh).
    slots: the rows of the cache: the requests decoded together.
    context: positions per slot (the prompt and the generated tokens together).
    chunk: the longest prompt chunk, a power of 2.
  """

  def __init__(self, model: Any, slots: int, context: int, chunk: int = CHUNK):
    if model.mesh is not None:
      raise ValueError("q8rules serve runs a model on one device; this one is on a mesh")
    if chunk < 1 or chunk & (chunk - 1):
      raise ValueError(f"the prompt chunk must be a power of 2, got {chunk}")
    if not 1 <= context <= model.config.context_length:
      raise ValueError(
        f"the context must be in [1, {model.config.context_length}] (the model's), got {context}"
      )
    self.model = model
    self.slots = slots
    self.context = context
    self.chunk = chunk
    self.vocab = model.config.vocab
    self.cache = init_cache(model.config, context, slots)
    self._decode = jax.jit(self._decode_step, donate_argnums=(1,))
    self._prefill = jax.jit(self._prefill_chunk, donate_argnums=(1,))

  def _decode_step(self, params, cache, tokens, positions, keys, history, settings):
    logits, cache = self.model.model.apply({"params": params}, tokens[:, None], cache, positions)
    return cache, sample_rows(logits[:, -1], keys, history, settings)

  def _prefill_chunk(self, params, cache, slot, tokens, pos, key, history, settings):
    row = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1), cache)
    logits, row = self.model.model.apply({"params": params}, tokens[None], row, pos, last_only=True)
    cache = jax.tree.map(
      lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=1), cache, row
    )
    return cache, sample_rows(logits[:, -1], key[None], history[None], settings)

  def prefill(
    self,
    slot: int,
    tokens: np.ndarray,
    pos: int,
    key: np.ndarray,
    history: np.ndarray,
    settings: RowSettings,
  ) -> Sampled:
    """Write the chunk `tokens` (T,) int32 at positions [pos, pos + T) of `slot`; the token
    after it (sampled with the one-row `settings`, `key` (2,) uint32 and `history`
    (HISTORY,) int32; meaningful after the prompt's last chunk), as a one-row `Sampled`."""
    self.cache, out = self._prefill(
      self.model.params,
      self.cache,
      jnp.int32(slot),
      jnp.asarray(tokens, jnp.int32),
      jnp.int32(pos),
      jnp.asarray(key, jnp.uint32),
      jnp.asarray(history, jnp.int32),
      settings,
    )
    return Sampled.of(out)

  def decode(
    self,
    tokens: np.ndarray,
    positions: np.ndarray,
    keys: np.ndarray,
    history: np.ndarray,
    settings: RowSettings,
  ) -> Sampled:
    """One step for every slot: row i runs `tokens[i]` at `positions[i]` ((P,) int32 each) and
    samples its next token (`keys` (P, 2) uint32, `history` (P, HISTORY) int32)."""
    self.cache, out = self._decode(
      self.model.params,
      self.cache,
      jnp.asarray(tokens, jnp.int32),
      jnp.asarray(positions, jnp.int32),
      jnp.asarray(keys, jnp.uint32),
      jnp.asarray(history, jnp.int32),
      settings,
    )
    return Sampled.of(out)

  def warm_up(self) -> None:
    """Compile the decode step and each chunk shape now (greedy and sampled, with and without
    log-probabilities), writing only slot 0 at position 0 (free: nothing there is read)."""
    settings = RowSettings.empty(self.slots)
    keys = np.zeros((self.slots, 2), np.uint32)
    history = np.full((self.slots, HISTORY), -1, np.int32)
    zeros = np.zeros((self.slots,), np.int32)
    self.decode(zeros, zeros, keys, history, settings)
    one = RowSettings.empty(1)
    for t in sorted(set(chunks(2 * self.chunk - 1, self.chunk))):
      if t <= self.context:
        self.prefill(0, np.zeros((t,), np.int32), 0, keys[0], history[0], one)


__all__ = ["CHUNK", "MAX_TOP_LOGPROBS", "BatchRunner", "Sampled", "chunks"]
