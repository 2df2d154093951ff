"""The server's sampling step (`q8rules.serve.sampling`): its greedy pick is `jnp.argmax`'s
(ties, infinities, NaN), and a row's token and key are the same bits whatever the other rows
ask for (penalties, temperature), so skipping the penalties when no row has one changes
nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.serve.sampling import HISTORY, RowSettings, SamplingParams, first_max, sample_rows


def test_first_max_is_argmax():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((6, 1000)).astype(np.float32)
  x[1, [3, 500, 999]] = 50.0  # a tie: the first
  x[2] = -np.inf
  x[3, 7] = np.inf
  x[4, [20, 30]] = np.nan  # the first NaN, as argmax
  x[5, 999] = 60.0  # the last index
  got = np.asarray(jax.jit(first_max)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert got.dtype == np.int32
  assert list(got[1:]) == [3, 0, 7, 20, 999]


def test_a_rows_token_does_not_depend_on_the_other_rows():
  rng = np.random.default_rng(1)
  vocab = 300
  logits = jnp.asarray(rng.standard_normal((4, vocab)), jnp.float32)
  history = np.full((4, HISTORY), -1, np.int32)
  history[:, -5:] = rng.integers(0, vocab, (4, 5))
  keys = np.stack([SamplingParams(seed=s).key() for s in range(4)])
  plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40, seed=1)]
  others = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=1.2, frequency_penalty=1.0, seed=3),
  ]
  run = jax.jit(sample_rows)

  def rows(params: list[SamplingParams]) -> tuple[np.ndarray, ...]:
    out = run(logits, jnp.asarray(keys), jnp.asarray(history), RowSettings.of(params))
    return tuple(np.asarray(a) for a in out)

  alone = rows([*plain, plain[0], plain[0]])
  for other in others:
    beside = rows([*plain, other, other])
    for got, want in zip(beside, alone, strict=True):
      np.testing.assert_array_equal(got[:2], want[:2])
  greedy = rows([plain[0]] * 4)
  np.testing.assert_array_equal(greedy[0], np.argmax(np.asarray(logits), axis=-1))
  np.testing.assert_array_equal(greedy[1], keys)  # a greedy row's key does not move
