"""The sampler chain (q8rules/engine/chain.py: logit bias, penalties, top-k, top-p, min-p,
temperature) against the float64 numpy chain (q8rules/engine/reference.py) on random logits
with ties, row by row in one batch; its draws; that it never sorts the vocabulary; that a
row's token does not depend on the other rows; and in the decode loop of a GGUF model."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.engine.chain import TOP_K_MAX, candidates, first_max, greedy_rows, sample_rows
from q8rules.engine.reference import reference_probabilities
from q8rules.engine.sampling import HISTORY, RowSettings, SamplingParams, history_of

S = SamplingParams
CASES = [
  S(temperature=0.8),
  S(temperature=1.0, top_k=5),
  S(temperature=0.7, top_p=0.9),
  S(temperature=0.7, top_p=0.5),
  S(temperature=1.3, min_p=0.05),
  S(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.3),
  S(temperature=0.9, top_k=TOP_K_MAX + 72, top_p=0.97),  # top-k as a threshold
  S(temperature=0.9, top_k=TOP_K_MAX + 72, min_p=0.01),
  S(temperature=1.0, repeat_penalty=1.5, penalty_last_n=4),
  S(temperature=0.6, frequency_penalty=0.7, presence_penalty=0.3, top_p=0.8),
  S(temperature=0.9, logit_bias=((3, 2.0), (11, -5.0)), top_p=0.7),
  S(temperature=0.0, top_k=3, repeat_penalty=2.0),  # greedy after the penalty
  S(temperature=0.0),
]


def chain_probabilities(logits: np.ndarray, recents: list[list[int]], params: list[S]):
  """Each row's probabilities (P, V) float64 under the traced chain: softmax of what it keeps
  over its temperature (greedy: 1 at its token)."""
  history = np.stack([history_of(r) for r in recents])
  s = RowSettings.of(params)
  kept = np.asarray(jax.jit(candidates)(jnp.asarray(logits), jnp.asarray(history), s))
  keys = jnp.asarray(np.stack([p.key() for p in params]))
  tokens = np.asarray(jax.jit(sample_rows)(jnp.asarray(logits), keys, jnp.asarray(history), s)[0])
  out = []
  for row, p in enumerate(params):
    if p.greedy:
      out.append(np.eye(logits.shape[1])[tokens[row]])
    else:
      out.append(np.asarray(jax.nn.softmax(kept[row] / p.temperature), np.float64))
  return np.stack(out)


@pytest.mark.parametrize("ties", ["top", "many"])
def test_chain_is_the_numpy_chain(ties):
  """Every case in one batch, each row against the numpy chain: the same ids kept (ties at the
  top-k and top-p cuts kept by id, as llama.cpp's stable sort), the same probabilities."""
  rng = np.random.default_rng(0 if ties == "top" else 1)
  vocab = 400
  for _ in range(4):
    if ties == "top":
      logits = (rng.standard_normal((len(CASES), vocab)) * 3).astype(np.float32)
      logits[:, 7] = logits[:, 9] = logits.max(axis=1)  # a tie at the top: the lower id first
    else:  # few distinct values: every cut falls inside a group of equal logits
      logits = (rng.integers(-6, 3, (len(CASES), vocab)) * 0.75).astype(np.float32)
    recents = [[int(i) for i in rng.integers(0, vocab, 12)] for _ in CASES]
    ours = chain_probabilities(logits, recents, CASES)
    for row, p in enumerate(CASES):
      ref = reference_probabilities(logits[row], recents[row], p)
      np.testing.assert_array_equal(ours[row] > 0, ref > 0, err_msg=str(p))
      np.testing.assert_allclose(ours[row], ref, atol=2e-6, err_msg=str(p))


def test_top_p_cut_inside_a_tie_group():
  """Ten equal logits, top-p 0.35: the first four ids of the group (by id) make the cut."""
  logits = np.zeros((1, 10), np.float32)
  p = S(temperature=1.0, top_p=0.35)
  ours = chain_probabilities(logits, [[]], [p])[0]
  np.testing.assert_array_equal(np.flatnonzero(ours), [0, 1, 2, 3])
  np.testing.assert_allclose(ours, reference_probabilities(logits[0], [], p), atol=1e-7)


def test_draws_follow_the_probabilities():
  """Draws of one fixed setting per path: their frequencies match the numpy chain's."""
  logits = np.linspace(-1.0, 2.0, 16, dtype=np.float32)
  for p in (S(temperature=0.8, top_k=6, top_p=0.9), S(temperature=0.8, top_p=0.9, min_p=0.1)):
    s = RowSettings.of([p])
    history = jnp.full((1, HISTORY), -1, jnp.int32)

    def draw(key, s=s, history=history):
      return sample_rows(jnp.asarray(logits)[None], key[None], history, s)[0][0]

    keys = jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(1), 20000))
    toks = np.asarray(jax.jit(jax.vmap(draw))(keys))
    freq = np.bincount(toks, minlength=16) / len(toks)
    ref = reference_probabilities(logits, [], p)
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(ref))
    np.testing.assert_allclose(freq, ref, atol=0.015)


def test_top_k_draw_is_the_draw_over_k():
  """A top-k row draws `categorical(sub, top_k(x, k) / t)` (its key split once): the draw
  over TOP_K_MAX candidates with the first k kept is the draw over the k."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((1, 1000)) * 2, jnp.float32)
  history = jnp.full((1, HISTORY), -1, jnp.int32)
  run = jax.jit(sample_rows)
  for seed in range(20):
    for k in (1, 7, 40, TOP_K_MAX):
      p = S(temperature=0.9, top_k=k, seed=seed)
      got = run(x, jnp.asarray(p.key())[None], history, RowSettings.of([p]))
      nxt, sub = jax.random.split(jax.random.key(seed))
      vals, ids = jax.lax.top_k(x[0], k)
      assert int(got[0][0]) == int(ids[jax.random.categorical(sub, vals / jnp.float32(0.9))])
      np.testing.assert_array_equal(got[1][0], jax.random.key_data(nxt))


def test_bad_settings():
  for kw in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
             dict(min_p=2.0), dict(repeat_penalty=0.0), dict(penalty_last_n=-1)):  # fmt: skip
    with pytest.raises(ValueError, match="must be"):
      S(**kw)
  for bad in (dict(seed=-1), dict(seed=1 << 32), dict(logit_bias=((-1, 1.0),)),
              dict(logit_bias=tuple((i, 1.0) for i in range(301)))):  # fmt: skip
    with pytest.raises(ValueError):
      S(**bad)


def test_history_keeps_the_last_ids():
  np.testing.assert_array_equal(history_of([1, 2], 4), [-1, -1, 1, 2])
  np.testing.assert_array_equal(history_of([1, 2, 3, 4, 5, 6], 4), [3, 4, 5, 6])
  assert history_of([1, 2], 0).shape == (0,)


def primitives(params: SamplingParams, vocab: int = 49152) -> set[str]:
  """The primitives of one traced sampling step over a vocabulary of `vocab` (nested too)."""
  logits, history = jnp.zeros((1, vocab), jnp.float32), jnp.full((1, HISTORY), -1, jnp.int32)
  s = RowSettings.of([params])
  jaxpr = jax.make_jaxpr(lambda x, k: sample_rows(x, k, history, s))(
    logits, jnp.zeros((1, 2), jnp.uint32)
  )
  out, todo = set(), [jaxpr.jaxpr]
  while todo:
    j = todo.pop()
    for eqn in j.eqns:
      out.add(eqn.primitive.name)
      todo += [
        v.jaxpr if hasattr(v, "jaxpr") else v for v in jax.extend.core.jaxprs_in_params(eqn.params)
      ]
  return out


def test_the_vocabulary_is_never_sorted():
  """No setting sorts the vocabulary: top-k takes `top_k`, top-p alone a bisection."""
  for p in CASES:
    assert "sort" not in primitives(p), p
  assert "top_k" in primitives(S(temperature=0.8, top_k=40))


def test_first_max_is_argmax(rng):
  """`first_max` gives `jnp.argmax`'s index on every row: the first of tied maxima, the first
  NaN where a row has one, the first of a row all -inf, +0 and -0 as equal."""
  rows = rng.choice(
    np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1.0, 2.0], np.float32),
    size=(64, 3000),
    p=[0.2, 0.005, 0.001, 0.2, 0.2, 0.2, 0.194],
  )
  rows[1] = -np.inf
  rows[2, :] = 0.0
  rows[2, 5] = -0.0
  rows[3] = rng.standard_normal(3000)
  rows[4] = rows[3]
  rows[4, 2999] = np.nan
  x = jnp.asarray(rows)
  want = np.asarray(jnp.argmax(x, axis=-1))
  got = np.asarray(jax.jit(first_max)(x))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)


def test_greedy_rows_are_the_chains_greedy_tokens(rng):
  """The argmax-only program (`greedy_rows`, a `greedy_only` runner's) gives the whole chain's
  tokens for plain greedy rows, bit for bit, with ties, -inf, NaN and a token mask; and a
  one-slot runner is made `greedy_only` for plain greedy settings alone."""
  vocab = 600
  logits = rng.choice(np.array([-np.inf, np.nan, 0.0, 1.0, 2.0], np.float32), (16, vocab),
                      p=[0.1, 0.002, 0.3, 0.3, 0.298])  # fmt: skip
  logits[8:] = rng.standard_normal((8, vocab))
  allowed = rng.integers(-(2**31), 2**31, (16, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
  keys = jnp.zeros((16, 2), jnp.uint32)
  history = jnp.full((16, HISTORY), -1, jnp.int32)
  settings = RowSettings.of([S(temperature=0.0)] * 16)
  for mask in (None, jnp.asarray(allowed)):
    want = jax.jit(sample_rows)(jnp.asarray(logits), keys, history, settings, mask)
    got = jax.jit(greedy_rows)(jnp.asarray(logits), keys, history, None, mask)
    for a, b in zip(got[:3], want[:3], strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert S(temperature=0.0).plain_argmax
  assert not S(temperature=0.0, logprobs=True).plain_argmax
  assert not S(temperature=0.0, repeat_penalty=1.1).plain_argmax
  assert not S(temperature=0.0, logit_bias=((3, 1.0),)).plain_argmax
  assert not S(temperature=0.5).plain_argmax


def test_a_rows_token_does_not_depend_on_the_other_rows():
  rng = np.random.default_rng(1)
  vocab = 300
  logits = jnp.asarray(rng.standard_normal((4, vocab)), jnp.float32)
  history = np.full((4, HISTORY), -1, np.int32)
  history[:, -5:] = rng.integers(0, vocab, (4, 5))
  keys = np.stack([S(seed=s).key() for s in range(4)])
  plain = [S(temperature=0.0), S(temperature=0.8, top_k=40, seed=1)]
  others = [
    S(temperature=0.0),
    S(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5),
    S(temperature=1.2, frequency_penalty=1.0, seed=3),
    S(temperature=1.2, top_p=0.8, top_k=200, min_p=0.1),
  ]
  run = jax.jit(sample_rows)

  def rows(params: list[S]) -> tuple[np.ndarray, ...]:
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
  keys = jnp.asarray(np.stack([S(seed=s).key() for s in range(3)]))
  history = jnp.full((3, HISTORY), -1, jnp.int32)
  top = np.argsort(-np.asarray(logits), axis=-1)
  run = jax.jit(sample_rows)
  sampled = S(temperature=0.7, seed=5)
  biased = [
    S(temperature=0.0, logit_bias=((17, 100.0),)),
    S(temperature=0.0, logit_bias=((int(top[2, 0]), -100.0),)),
  ]
  out = [np.asarray(a) for a in run(logits, keys, history, RowSettings.of([sampled, *biased]))]
  assert out[0][1] == 17 and out[0][2] == top[2, 1] and top[1, 0] != 17
  alone = [np.asarray(a) for a in run(logits, keys, history, RowSettings.of([sampled] * 3))]
  np.testing.assert_array_equal(out[0][0], alone[0][0])  # the unbiased row: the same bits
  np.testing.assert_array_equal(out[1][0], alone[1][0])
  with_lp = [S(temperature=0.0, logprobs=True, logit_bias=((17, 100.0),))]
  got = run(logits[1:2], keys[1:2], history[1:2], RowSettings.of(with_lp))
  want = jax.nn.log_softmax(logits[1])[17]
  assert int(got[0][0]) == 17
  np.testing.assert_allclose(np.asarray(got[3])[0], np.asarray(want), rtol=1e-6)


@pytest.mark.slow
def test_decode_loop_samples_as_the_chain_does():
  """A greedy decode with a strong penalty and top-k on the tiny qwen2 (whose greedy text
  repeats itself): each new token is the numpy chain's pick from the model's logits at that
  point, the penalty seeing the prompt and every token generated so far (the history carried
  across the loop's chunks)."""
  import q8rules

  path = Path(__file__).parent / "data" / "gguf_models" / "tiny-qwen2-q8_0.gguf"
  m = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
  params = S(temperature=0.0, top_k=20, repeat_penalty=3.0, penalty_last_n=6)
  prompt = [1, 5, 9, 3]
  new = m.generate(prompt, 20, sampler=params)  # more than one chunk of the loop
  assert len(new) == 20
  logits = m.logits(prompt + new[:-1])  # one pass: position i's logits see ids[: i + 1]
  ids = list(prompt)
  for t in new:
    want = reference_probabilities(logits[len(ids) - 1], ids, params).argmax()
    assert t == want, (ids, t, want)
    ids.append(t)
  plain = m.generate(prompt, 20)
  assert len(set(plain)) < 12 and new != plain  # the penalty changed a repeating greedy text
