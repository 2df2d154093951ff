"""A packed token bitmask applied to logits on the device.

Layout (llguidance's): row r allows token j iff bit `j % 32` of `bitmask[r, j // 32]` is set;
a free row is all ones (`free_bitmask`). Disallowed tokens' logits become -inf before the
sampler's chain, so greedy and sampled rows alike pick among the allowed ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def words_for(vocab: int) -> int:
  """int32 words a bitmask row of `vocab` tokens takes."""
  return (vocab + 31) // 32


def free_bitmask(rows: int, vocab: int) -> np.ndarray:
  """(rows, words_for(vocab)) int32, every token allowed."""
  return np.full((rows, words_for(vocab)), -1, dtype=np.int32)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
  """`logits` (rows, vocab) float with disallowed tokens at -inf.

  Args:
    logits: (rows, vocab) float32.
    bitmask: (rows, words_for(vocab)) int32 (or uint32).
  """
  vocab = logits.shape[-1]
  ids = jnp.arange(vocab, dtype=jnp.int32)
  words = bitmask.astype(jnp.uint32)[:, ids // 32]  # (rows, vocab)
  allowed = (words >> (ids % 32).astype(jnp.uint32)) & 1
  return jnp.where(allowed.astype(bool), logits, -jnp.inf)
