"""The batched KV cache and the device programs a server runs on it: a prompt chunk into one
slot, one decode step for every slot, and freeing a slot.

The cache is the decoder's own (`q8rules.models.init_cache`) with `slots` rows: row i is slot
i, `context` positions long. A running request owns a slot from its first prompt chunk to its
last token. Beside the cache, each row's state stays on the device (`Rows`): its next input
token and position, its sampling key and recent ids, and whether it is decoding. A decode step
reads them and writes the next ones, so consecutive steps need nothing from the host: the host
reads each step's tokens while the next step runs, and one program runs up to `steps` steps
(a loop on the device whose count is an argument: the same compiled step every time).

  runner = BatchRunner(model, slots=4, context=2048)
  runner.free(slot)                                    # a new request's slot: not decoding
  out = runner.prefill(slot, ids[0:64], 0, key, history, settings, last=False)
  out = runner.prefill(slot, ids[64:72], 64, key, history, settings, last=True)  # now decoding
  step = runner.decode(4)                              # every decoding row 4 tokens
  step.fetch(logprobs=False).tokens                    # (4, P), once the steps are done

A decode step runs the decoder on tokens (P, 1) with one position per row (the decoder's
per-row positions: each row writes, masks and attends at its own position), so every weight is
read once for all P rows, and a row's logits are the same computation whatever the other rows
hold: its product rows are computed on their own, its attention runs per row, its sampling
(`q8rules.engine.chain`) uses its own settings and key. Rows that are not decoding (free, or
between prompt chunks) still run, on a dummy token at their next position, and do not move on:
what it writes there is overwritten before it is ever visible (the next chunk or token writes
that position first; in a sliding-window ring, that slot holds a position outside every later
token's window).

A prompt chunk runs the decoder on that slot's row alone (batch 1, copied out of the cache and
back), T tokens at one position; the chunk sizes depend on the prompt's length only
(`chunks`), so a request's prefill is the same computation in any slot beside any others. The
prompt's last chunk is followed by one sampling program (the same for every chunk shape: the
sampler chain is compiled once) that draws the request's first token and makes its row decode
from there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.engine.bitmask import free_bitmask
from q8rules.engine.chain import greedy_rows, sample_rows
from q8rules.engine.sampling import HISTORY, MAX_TOP_LOGPROBS, RowSettings, SamplingParams

CHUNK = 128
"""The longest prompt chunk prefilled between two decode steps (a power of 2)."""

STEPS = 4
"""The most decode steps one device program runs (when no prompt waits for its next chunk)."""


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
class Rows:
  """Each row's decode state, on the device (a pytree of (P, ...) arrays).

  Attributes:
    tokens: (P,) int32, the token a decoding row runs next (its last sampled one).
    positions: (P,) int32, where that token goes (a row that is not decoding writes its dummy
      token there).
    keys: (P, 2) uint32, each row's key data.
    history: (P, H) int32 (H: the runner's `history`), each row's last ids, newest last (-1 for none).
    active: (P,) bool, whether a row is decoding (its steps sample and move it on).
  """

  tokens: jax.Array
  positions: jax.Array
  keys: jax.Array
  history: jax.Array
  active: jax.Array

  @classmethod
  def empty(cls, rows: int, history: int = HISTORY) -> Rows:
    """`rows` rows that are not decoding, at position 0 (host arrays), each keeping `history`
    recent ids."""
    return cls(
      np.zeros((rows,), np.int32),
      np.zeros((rows,), np.int32),
      np.zeros((rows, 2), np.uint32),
      np.full((rows, history), -1, np.int32),
      np.zeros((rows,), bool),
    )


jax.tree_util.register_dataclass(
  Rows, data_fields=["tokens", "positions", "keys", "history", "active"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class Sampled:
  """What a device program sampled per step and row, on the host (S steps, P rows).

  Attributes:
    tokens: (S, P) int32, each row's token of each step.
    logprobs: (S, P) float32, the tokens' log-probabilities (0 when no row asked).
    top_ids, top_logprobs: (S, P, MAX_TOP_LOGPROBS) int32 / float32, the most likely ids (None
      when not fetched).
  """

  tokens: np.ndarray
  logprobs: np.ndarray | None = None
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Step:
  """A program's samples, still on the device (it may still be running)."""

  out: tuple[jax.Array, ...]
  """tokens (S, P), logprobs (S, P), top ids and top log-probabilities (S, P, MAX_TOP_LOGPROBS)
  (S: the program's most steps; past the steps it ran, zeros)."""

  def fetch(self, logprobs: bool) -> Sampled:
    """The samples on the host (waits for the program); the log-probabilities too when
    `logprobs`."""
    if not logprobs:
      return Sampled(np.asarray(self.out[0]))
    return Sampled(*(np.asarray(a) for a in self.out))


def _like_output(out: jax.ShapeDtypeStruct) -> jax.Array:
  """Zeros as a program gives `out`: on one device uncommitted (as the outputs of a program
  whose inputs are), over a mesh committed to its sharding; a program lowered for them is the
  one a call with that output compiles."""
  zeros = np.zeros(out.shape, out.dtype)
  if isinstance(out.sharding, jax.sharding.SingleDeviceSharding):
    return jnp.asarray(zeros)
  return jax.device_put(zeros, out.sharding)


class BatchRunner:
  """A model's batched KV cache (`slots` rows of `context` positions), its rows' state and its
  programs.

  Args:
    model: a `GGUFModel`: its module and params, and where the runner's arrays go
      (`new_cache`, `on_device`, `products`: on one device, or split over its mesh as its
      own calls are, over one process or several).
    slots: the rows of the cache: the requests decoded together.
    context: positions per slot (the prompt and the generated tokens together).
    chunk: the longest prompt chunk, a power of 2.
    steps: the most decode steps one program runs.
    history: the recent ids each row keeps for the penalties (`penalty_last_n` at most this).
    greedy_only: every row samples as plain argmax (`SamplingParams.plain_argmax`; others are
      refused by `set_settings`): the programs hold the argmax instead of the whole sampler
      chain (`chain.greedy_rows`: the same tokens), a few seconds less to compile.
  """

  def __init__(
    self,
    model: Any,
    slots: int,
    context: int,
    chunk: int = CHUNK,
    steps: int = STEPS,
    history: int = HISTORY,
    greedy_only: bool = False,
  ):
    if chunk < 1 or chunk & (chunk - 1):
      raise ValueError(f"the prompt chunk must be a power of 2, got {chunk}")
    if steps < 1:
      raise ValueError(f"the decode steps a program runs must be >= 1, got {steps}")
    if not 1 <= context <= model.config.context_length:
      raise ValueError(
        f"the context must be in [1, {model.config.context_length}] (the model's), got {context}"
      )
    self.model = model
    self.slots = slots
    self.context = context
    self.chunk = chunk
    self.steps = steps
    self.history = history
    self.greedy_only = greedy_only
    self._sample = greedy_rows if greedy_only else sample_rows
    self.vocab = model.config.vocab
    self.cache = model.new_cache(context, slots)
    self.rows = self._place(Rows.empty(slots, history))
    self.settings = RowSettings.empty(slots)
    self._device_settings: RowSettings | None = None
    self.allowed = free_bitmask(slots, self.vocab)
    self._device_allowed: jax.Array | None = None
    self.keeps_prefixes = not any(model.config.is_local)
    """Whether a slot's cache keeps what its prompts wrote, for a later request to reuse: with
    no sliding-window layer (a window's ring overwrites old positions) and free rows parked at
    the last position, where a dummy token never lands on a prompt's."""
    self._decode = jax.jit(self._decode_steps, donate_argnums=(1, 2))
    self._prefill = jax.jit(self._prefill_chunk, donate_argnums=(1, 2))
    self._start = jax.jit(self._start_row, donate_argnums=(0,))
    self._free = jax.jit(self._free_row, donate_argnums=(0,))

  def _place(self, tree: Any) -> Any:
    """Host values (numpy leaves) as the model's device arrays (replicated over its mesh)."""
    return jax.tree.map(lambda a: self.model.on_device(a, np.asarray(a).dtype), tree)

  def _decode_step(self, params, cache, rows: Rows, settings, allowed):
    tokens = jnp.where(rows.active, rows.tokens, 0)  # a dummy token where not decoding
    positions = jnp.minimum(rows.positions, self.context - 1)
    logits, cache = self.model.model.apply({"params": params}, tokens[:, None], cache, positions)
    tok, keys, history, *rest = self._sample(
      logits[:, -1], rows.keys, rows.history, settings, allowed
    )
    a = rows.active
    rows = Rows(
      jnp.where(a, tok, rows.tokens),
      jnp.where(a, rows.positions + 1, rows.positions),
      jnp.where(a[:, None], keys, rows.keys),
      jnp.where(a[:, None], history, rows.history),
      a,
    )
    return cache, rows, (tok, *rest)

  def _decode_steps(self, params, cache, rows: Rows, settings, allowed, n):
    """`n` (<= `steps`, traced) decode steps in a loop; their samples stacked (steps, P, ...)."""
    p = self.slots
    k = min(MAX_TOP_LOGPROBS, self.vocab)
    outs = (
      jnp.zeros((self.steps, p), jnp.int32),
      jnp.zeros((self.steps, p), jnp.float32),
      jnp.zeros((self.steps, p, k), jnp.int32),
      jnp.zeros((self.steps, p, k), jnp.float32),
    )

    def body(i, carry):
      cache, rows, outs = carry
      cache, rows, out = self._decode_step(params, cache, rows, settings, allowed)
      return cache, rows, tuple(o.at[i].set(x) for o, x in zip(outs, out, strict=True))

    return jax.lax.fori_loop(0, n, body, (cache, rows, outs))

  def _prefill_chunk(self, params, cache, rows: Rows, slot, tokens, pos):
    """The chunk `tokens` (T,) into row `slot` of the cache at [pos, pos + T): the cache, the
    rows with that row waiting at pos + T (not decoding), and the chunk's last logits (1, V)."""
    row = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1), cache)
    logits, row = self.model.model.apply({"params": params}, tokens[None], row, pos, last_only=True)
    cache = jax.tree.map(
      lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=1), cache, row
    )
    rows = dataclasses.replace(
      rows,
      positions=rows.positions.at[slot].set(pos + tokens.shape[0]),
      active=rows.active.at[slot].set(False),
    )
    return cache, rows, logits[:, -1]

  def _start_row(self, rows: Rows, logits, slot, key, history, settings, allowed):
    """Row `slot`'s first token sampled from the prompt's last logits (1, V), and the row
    decoding from it: the rows, and the sample as a one-step, one-row program's output."""
    tok, keys, hist, *rest = self._sample(logits, key[None], history[None], settings, allowed[None])
    rows = Rows(
      rows.tokens.at[slot].set(tok[0]),
      rows.positions,
      rows.keys.at[slot].set(keys[0]),
      rows.history.at[slot].set(hist[0]),
      rows.active.at[slot].set(True),
    )
    return rows, (tok[None], *(a[None] for a in rest))

  @staticmethod
  def _free_row(rows: Rows, slot, park):
    return dataclasses.replace(
      rows, positions=rows.positions.at[slot].set(park), active=rows.active.at[slot].set(False)
    )

  def free(self, slot: int) -> None:
    """Row `slot` stops decoding; its settings become greedy with nothing else on. Its dummy
    token goes to the last position when the cache keeps prefixes (`keeps_prefixes`: a later
    prompt that starts the same reuses what this one wrote; a request writes the last position
    before it reads it), else to position 0 (where a next request's prompt writes first)."""
    park = self.context - 1 if self.keeps_prefixes else 0
    with self.model.products():
      self.rows = self._free(self.rows, *self._place((np.int32(slot), np.int32(park))))
    self.set_settings(slot, SamplingParams(temperature=0.0))
    self.set_allowed(slot, None)

  def set_settings(self, slot: int, params: SamplingParams) -> None:
    """Row `slot` samples with `params` from the next decode step on (ValueError on a
    `greedy_only` runner for params that are not plain argmax)."""
    if self.greedy_only and not params.plain_argmax:
      raise ValueError(
        f"this runner decodes greedily only (no bias, penalty or logprobs): {params}"
      )
    self.settings.set(slot, params)
    self._device_settings = None

  def set_allowed(self, slot: int, bits: np.ndarray | None) -> None:
    """Row `slot`'s allowed tokens for the next decode step: `bits` (words,) int32, a packed
    bitmask (`q8rules.engine.bitmask`), or None (every token)."""
    self.allowed[slot] = -1 if bits is None else bits
    self._device_allowed = None

  def prefill(
    self,
    slot: int,
    tokens: np.ndarray,
    pos: int,
    key: np.ndarray,
    history: np.ndarray,
    settings: RowSettings,
    last: bool,
    allowed: np.ndarray | None = None,
  ) -> Step | None:
    """Write the chunk `tokens` (T,) int32 at positions [pos, pos + T) of `slot`. After the
    prompt's `last` chunk, the token after it is sampled (with the one-row `settings`, `key`
    (2,) uint32 and `history` (`history`,) int32, among the tokens `allowed` (words,) int32 lets
    through, every token when None), the row decodes from it at pos + T, and it is returned as
    a one-step, one-row `Step`; before the last chunk the row waits and None is returned.

    The chunk and the first token are two programs: one a chunk shape (the decoder alone) and
    one sampling program for every prompt, so the sampler chain is compiled once, not once a
    chunk shape."""
    with self.model.products():
      self.cache, self.rows, logits = self._prefill(
        self.model.params, self.cache, self.rows,
        *self._place((np.int32(slot), np.asarray(tokens, np.int32), np.int32(pos))),
      )  # fmt: skip
      if not last:
        return None
      if allowed is None:
        allowed = free_bitmask(1, self.vocab)[0]
      host = (
        np.int32(slot),
        np.asarray(key, np.uint32),
        np.asarray(history, np.int32),
        settings,
        np.asarray(allowed, np.int32),
      )
      self.rows, out = self._start(self.rows, logits, *self._place(host))
    return Step(out)

  def decode(self, n: int = 1) -> Step:
    """`n` steps (1 <= n <= `steps`) for every slot: in each, each decoding row runs its token
    at its position and samples its next (with its settings, key and recent ids), and moves
    on; the others write a dummy token and stay. Returns at once (the steps run on the
    device)."""
    if not 1 <= n <= self.steps:
      raise ValueError(f"decode runs 1 to {self.steps} steps, got {n}")
    if self._device_settings is None:
      self._device_settings = self._place(self.settings)
    if self._device_allowed is None:
      self._device_allowed = self._place(self.allowed)
    with self.model.products():
      self.cache, self.rows, out = self._decode(
        self.model.params,
        self.cache,
        self.rows,
        self._device_settings,
        self._device_allowed,
        self._place(np.int32(n)),
      )
    return Step(out)

  def warm_up(self) -> None:
    """Compile the decode step, each chunk shape and the slot's release now, without running
    any of them (running them cost a prefill of every chunk shape over the slot's row of the
    cache): each is lowered for the arguments its calls pass and compiled ahead of time, which
    puts it in `jax.jit`'s caches (and in the persistent compilation cache, when on), so its
    first call runs at once. The first request's key (`jax.random.key`) is compiled too."""
    place, params, cache, rows = self._place, self.model.params, self.cache, self.rows
    with self.model.products():  # the arguments placed as the calls place theirs
      settings, allowed, one = place(self.settings), place(self.allowed), place(np.int32(1))
      self._decode.lower(params, cache, rows, settings, allowed, one).compile()
      self._free.lower(rows, *place((np.int32(0), np.int32(0)))).compile()
      logits = None
      for t in sorted(set(chunks(2 * self.chunk - 1, self.chunk))):
        if t <= self.context:
          chunk = place((np.int32(0), np.zeros(t, np.int32), np.int32(0)))
          out = self._prefill.lower(params, cache, rows, *chunk).compile().out_info[2]
          logits = _like_output(out)
      host = (
        np.int32(0),
        np.zeros(2, np.uint32),
        np.full(self.history, -1, np.int32),
        RowSettings.empty(1),
        free_bitmask(1, self.vocab)[0],
      )
      self._start.lower(rows, logits, *place(host)).compile()
    SamplingParams(temperature=0.0).key()


__all__ = [
  "CHUNK",
  "MAX_TOP_LOGPROBS",
  "STEPS",
  "BatchRunner",
  "Rows",
  "Sampled",
  "Step",
  "chunks",
]
