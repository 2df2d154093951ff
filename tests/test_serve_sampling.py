"""The server's sampling step (`q8rules.serve.sampling`): its greedy pick is `jnp.argmax`'s
(ties, infinities, NaN), and a row's token and key are the same bits whatever the other rows
ask for (penalties, temperature), so skipping the penalties when no row has one changes
nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_logit_bias_adds_to_its_rows_logits_only():
  """A row's `logit_bias` is added to its logits before the chain: +100 makes an id the greedy
  pick, -100 on the argmax moves the pick to the runner-up; a row without a bias keeps the
  same token and key bits beside biased rows, and the log-probabilities stay the model's."""
  rng = np.random.default_rng(2)
  vocab = 300
  logits = jnp.asarray(rng.standard_normal((3, vocab)), jnp.float32)
  keys = jnp.asarray(np.stack([SamplingParams(seed=s).key() for s in range(3)]))
  history = jnp.full((3, HISTORY), -1, jnp.int32)
  top = np.argsort(-np.asarray(logits), axis=-1)
  run = jax.jit(sample_rows)
  sampled = SamplingParams(temperature=0.7, seed=5)
  biased = [
    SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)),
    SamplingParams(temperature=0.0, logit_bias=((int(top[2, 0]), -100.0),)),
  ]
  out = [np.asarray(a) for a in run(logits, keys, history, RowSettings.of([sampled, *biased]))]
  assert out[0][1] == 17 and out[0][2] == top[2, 1] and top[1, 0] != 17
  alone = [np.asarray(a) for a in run(logits, keys, history, RowSettings.of([sampled] * 3))]
  np.testing.assert_array_equal(out[0][0], alone[0][0])  # the unbiased row: the same bits
  np.testing.assert_array_equal(out[1][0], alone[1][0])
  with_lp = [SamplingParams(temperature=0.0, logprobs=True, logit_bias=((17, 100.0),))]
  got = run(logits[1:2], keys[1:2], history[1:2], RowSettings.of(with_lp))
  want = jax.nn.log_softmax(logits[1])[17]
  assert int(got[0][0]) == 17
  np.testing.assert_allclose(np.asarray(got[3])[0], np.asarray(want), rtol=1e-6)


def test_sampling_params_refuse_what_the_api_must_have_checked():
  for bad in (dict(seed=-1), dict(seed=1 << 32), dict(logit_bias=((-1, 1.0),)),
              dict(logit_bias=tuple((i, 1.0) for i in range(301)))):  # fmt: skip
    with pytest.raises(ValueError):
      SamplingParams(**bad)
