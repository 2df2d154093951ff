"""The decoder with one position per row (what `q8rules serve` decodes with): each row of a
batch at its own position gives that sequence's own tokens, on a model with sliding-window
layers (ring caches) and global ones; one-token attention given a position per row is each row
alone."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import q8rules
from q8rules.attention_params import AttentionCall, AttentionParams
from q8rules.kernels.decode_attention import cpu as attention_cpu
from q8rules.kernels.decode_attention.api import attend
from q8rules.kernels.native import library as native_lib
from q8rules.models.attention import init_cache

DATA = Path(__file__).parent / "data" / "gguf_models"


@pytest.mark.slow
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


@pytest.mark.skipif(not native_lib.available(), reason="the native kernel is unavailable")
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_attention_with_a_position_per_row_is_each_row_alone(dtype):
  """One-token attention given positions (B,) (one kernel call for the batch): row b is the
  same bits as row b alone at its own scalar position, on the native kernel and on the
  reference; a position past the cache is clamped, and a count of positions other than 1 or
  B is refused."""
  rng = np.random.default_rng(0)
  b, layers, s, kv, h, d = 4, 3, 24, 2, 6, 64
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((layers, b, s, kv, d)).astype(dtype))
  values = jnp.asarray(rng.standard_normal((layers, b, s, kv, d)).astype(dtype))
  pos = np.asarray([0, 11, 23, 40], np.int32)
  params = AttentionParams.of(1 / np.sqrt(d), None, None)
  for name in ("cpu", "xla"):
    run = jax.jit(
      lambda q, k, v, p, name=name: attend(
        AttentionCall(q, k, v, 1, p, params), implementation=name
      )
    )
    batch = np.asarray(run(q, keys, values, jnp.asarray(pos)))
    for i in range(b):
      row = [a[:, i : i + 1] for a in (keys, values)]
      alone = np.asarray(run(q[i : i + 1], *row, jnp.int32(min(pos[i], s - 1))))
      np.testing.assert_array_equal(batch[i : i + 1], alone)
  with pytest.raises(Exception, match="one position, or one per row"):
    attention_cpu.decode_attention_cpu(
      q[:, 0], keys, values, 1, jnp.zeros((3,), jnp.int32), scale=0.125, softcap=None
    ).block_until_ready()
