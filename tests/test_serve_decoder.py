"""The decoder with one position per row (what `q8rules serve` decodes with): each row of a
batch at its own position gives that sequence's own tokens, on a model with sliding-window
layers (ring caches) and global ones."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import q8rules
from q8rules.models.attention import init_cache

DATA = Path(__file__).parent / "data" / "gguf_models"


def test_per_row_positions_decode_each_sequence_as_alone():
  m = q8rules.load_gguf(DATA / "tiny-gemma2-q8_0.gguf", dtype=jnp.float32, progress=False)
  apply = jax.jit(m.model.apply)
  variables = {"params": m.params}
  prompts = [[1, 5, 7, 9, 11, 13], [2, 3], [4, 8, 15, 16, 23, 42, 17, 19, 21, 25]]
  length, steps = 32, 5

  def alone(p):
    logits, cache = apply(variables, jnp.asarray([p]), init_cache(m.config, length, 1), 0)
    toks = [int(jnp.argmax(logits[0, -1]))]
    for i in range(steps):
      logits, cache = apply(variables, jnp.asarray([[toks[-1]]]), cache, len(p) + i)
      toks.append(int(jnp.argmax(logits[0, -1])))
    return toks, np.asarray(logits[0, -1])

  want = [alone(p) for p in prompts]
  batch = init_cache(m.config, length, len(prompts))
  toks = []
  for b, p in enumerate(prompts):
    logits, row = apply(variables, jnp.asarray([p]), init_cache(m.config, length, 1), 0)
    batch = jax.tree.map(lambda a, r, b=b: a.at[:, b : b + 1].set(r), batch, row)
    toks.append([int(jnp.argmax(logits[0, -1]))])
  pos = np.asarray([len(p) for p in prompts], np.int32)
  for i in range(steps):
    last = jnp.asarray([[t[-1]] for t in toks])
    logits, batch = apply(variables, last, batch, jnp.asarray(pos + i))
    for b in range(len(prompts)):
      toks[b].append(int(jnp.argmax(logits[b, -1])))
  for b, (w_toks, w_logits) in enumerate(want):
    assert toks[b] == w_toks
    np.testing.assert_allclose(np.asarray(logits[b, -1]), w_logits, rtol=1e-5, atol=1e-5)
