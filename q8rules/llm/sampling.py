"""Choosing the next token from one position's logits, as llama.cpp's default sampler chain
does: repetition penalty, then top-k, top-p, min-p, temperature, and a draw (greedy: the
argmax after the penalty).

`Sampler` holds the settings; `sample(logits, key, recent, temperature, settings)` is the
traced step the decode loop runs on the device. `reference_probabilities` is the same chain
in float64 numpy (the tests' yardstick).

The steps, on the logits `l` (vocab,) float32:
  penalty   each distinct id among the last `repeat_last_n` tokens (prompt included):
            l /= repeat_penalty where l > 0, else l *= repeat_penalty (llama.cpp's
            `llama_sampler_penalties`, with no frequency or presence term);
  top-k     keep the k largest (llama.cpp's order: the first k of a stable descending sort);
  top-p     keep the smallest prefix of the descending probabilities (softmax of what is
            left) whose sum reaches p (at least one);
  min-p     keep the ids whose probability is at least min_p times the largest;
  temperature  l / temperature, then a categorical draw over what is kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampler:
  """How the next token is chosen. The defaults turn every step off: greedy decoding.

  Attributes:
    temperature: 0 (greedy: the argmax) or > 0 (a draw from softmax(l / temperature)).
    top_k: keep the k most likely ids (0: off).
    top_p: keep the most likely ids up to this probability mass (1.0: off).
    min_p: keep the ids at least this fraction of the most likely one's probability (0: off).
    repeat_penalty: divide the positive logits (multiply the negative ones) of recently seen
      ids by this (1.0: off).
    repeat_last_n: how many of the last tokens the penalty looks at.
    seed: the draws' PRNG seed.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repeat_penalty: float = 1.0
  repeat_last_n: int = 64
  seed: int = 0

  def __post_init__(self) -> None:
    checks = [
      (self.temperature >= 0, "temperature must be >= 0"),
      (self.top_k >= 0, "top_k must be >= 0"),
      (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
      (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
      (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
      (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
    ]
    for ok, message in checks:
      if not ok:
        raise ValueError(f"{message}, got {self}")

  @property
  def greedy(self) -> bool:
    return not self.temperature > 0

  @property
  def history(self) -> int:
    """How many recent ids the decode loop keeps for the penalty (0 when it is off)."""
    return self.repeat_last_n if self.repeat_penalty != 1.0 else 0

  def settings(self) -> tuple:
    """What the traced step specializes on (a static jit argument): all but the temperature
    and the seed."""
    return (self.greedy, self.top_k, self.top_p, self.min_p, self.repeat_penalty, self.history)

  def recent(self, ids: np.ndarray | list[int]) -> jax.Array:
    """The last `history` of `ids` as int32 (history,), padded in front with -1."""
    ids = np.asarray(ids, np.int32).reshape(-1)[-self.history :] if self.history else ()
    out = np.full((self.history,), -1, np.int32)
    if self.history and len(ids):
      out[-len(ids) :] = ids
    return jnp.asarray(out)


def _penalize(logits: jax.Array, recent: jax.Array, penalty: float) -> jax.Array:
  seen = jnp.zeros(logits.shape, bool).at[jnp.where(recent >= 0, recent, logits.shape[0])]
  seen = seen.set(True, mode="drop")
  hit = jnp.where(logits > 0, logits / penalty, logits * penalty)
  return jnp.where(seen, hit, logits)


def _keep(logits: jax.Array, keep: jax.Array) -> jax.Array:
  return jnp.where(keep, logits, -jnp.inf)


def filtered(logits: jax.Array, recent: jax.Array, settings: tuple) -> jax.Array:
  """The logits (vocab,) float32 after the penalty, top-k, top-p and min-p of `settings`
  (`Sampler.settings()`): the removed ids at -inf."""
  _, top_k, top_p, min_p, penalty, history = settings
  x = logits.astype(jnp.float32)
  if history:
    x = _penalize(x, recent, penalty)
  if top_k or top_p < 1.0:
    order = jnp.argsort(-x, stable=True)  # descending, ties in id order (llama.cpp's sort)
    ranked = x[order]
    keep = jnp.ones(x.shape, bool)
    if top_k:
      keep = keep & (jnp.arange(x.shape[0]) < top_k)
    if top_p < 1.0:
      p = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
      before = jnp.cumsum(p) - p  # the mass ahead of each id: keep it while that is < top_p
      keep = keep & (before < top_p)
    x = jnp.full(x.shape, -jnp.inf).at[order].set(_keep(ranked, keep))
  if min_p > 0.0:
    p = jax.nn.softmax(x)
    x = _keep(x, p >= min_p * p.max())
  return x


def sample(
  logits: jax.Array, key: jax.Array, recent: jax.Array, temperature: jax.Array, settings: tuple
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(token int32, next key, recent ids with the token appended) from one position's logits
  (vocab,). Greedy: the argmax of the filtered logits, the key unchanged; else each draw
  splits the key once (`key, sub = split(key)`; `categorical(sub, filtered / temperature)`)."""
  greedy, *_, history = settings
  x = filtered(logits, recent, settings)
  if greedy:
    tok = jnp.argmax(x).astype(jnp.int32)
  else:
    key, sub = jax.random.split(key)
    tok = jax.random.categorical(sub, x / temperature).astype(jnp.int32)
  if history:
    recent = jnp.concatenate([recent[1:], tok[None]])
  return tok, key, recent


def reference_probabilities(logits: np.ndarray, recent: list[int], sampler: Sampler) -> np.ndarray:
  """The chain in float64 numpy, written the plain way (a sort, loops): the probability of
  each id (vocab,) under `sampler` (greedy: 1 at the argmax)."""
  x = np.asarray(logits, np.float64).copy()
  if sampler.history:
    for i in set(r for r in recent[-sampler.repeat_last_n :] if r >= 0):
      x[i] = x[i] / sampler.repeat_penalty if x[i] > 0 else x[i] * sampler.repeat_penalty
  order = sorted(range(len(x)), key=lambda i: (-x[i], i))
  kept = order[: sampler.top_k] if sampler.top_k else order
  if sampler.top_p < 1.0:
    e = np.exp(x[kept] - x[kept].max())
    p, mass, cut = e / e.sum(), 0.0, []
    for i, pi in zip(kept, p, strict=True):
      if mass >= sampler.top_p:
        break
      cut.append(i)
      mass += pi
    kept = cut
  if sampler.min_p > 0.0:
    e = np.exp(x[kept] - x[kept].max())
    p = e / e.sum()
    kept = [i for i, pi in zip(kept, p, strict=True) if pi >= sampler.min_p * p.max()]
  out = np.zeros(len(x))
  if sampler.greedy:
    out[max(kept, key=lambda i: (x[i], -i))] = 1.0
    return out
  z = x[kept] / sampler.temperature
  e = np.exp(z - z.max())
  out[kept] = e / e.sum()
  return out


__all__ = ["Sampler", "filtered", "reference_probabilities", "sample"]
