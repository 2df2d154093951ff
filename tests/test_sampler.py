"""The sampler chain (q8rules/llm/sampling.py: repetition penalty, top-k, top-p, min-p,
temperature) against a float64 numpy sampler on fixed logits, and in the decode loop of a
GGUF model: each token is the one the numpy chain picks from the model's own logits."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm.sampling import Sampler, filtered, first_max, reference_probabilities, sample

CASES = [
  Sampler(temperature=0.8),
  Sampler(temperature=1.0, top_k=5),
  Sampler(temperature=0.7, top_p=0.9),
  Sampler(temperature=1.3, min_p=0.05),
  Sampler(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.3),
  Sampler(temperature=1.0, repeat_penalty=1.5, repeat_last_n=4),
  Sampler(top_k=3, repeat_penalty=2.0),  # greedy after the penalty
  Sampler(),
]


def probabilities(logits: np.ndarray, recent: list[int], sampler: Sampler) -> np.ndarray:
  x = filtered(jnp.asarray(logits), sampler.recent(recent), sampler.settings())
  if sampler.greedy:
    return np.eye(len(logits))[int(jnp.argmax(x))]
  return np.asarray(jax.nn.softmax(x / sampler.temperature), np.float64)


@pytest.mark.parametrize("sampler", CASES, ids=str)
def test_chain_is_the_numpy_chain(sampler):
  rng = np.random.default_rng(0)
  for _ in range(5):
    logits = (rng.standard_normal(200) * 3).astype(np.float32)
    logits[7] = logits[9] = logits.max()  # a tie at the top: the lower id wins
    recent = [int(i) for i in rng.integers(0, 200, 12)] + [int(np.argmax(logits))]
    ours = probabilities(logits, recent, sampler)
    ref = reference_probabilities(logits, recent, sampler)
    np.testing.assert_array_equal(ours > 0, ref > 0)  # the same ids kept
    np.testing.assert_allclose(ours, ref, atol=2e-6)


def test_draws_follow_the_probabilities():
  """Draws of one fixed setting: their frequencies match the numpy chain's probabilities."""
  sampler = Sampler(temperature=0.8, top_k=6, top_p=0.9)
  logits = jnp.asarray(np.linspace(-1.0, 2.0, 16), jnp.float32)
  draw = jax.jit(lambda k: sample(logits, k, sampler.recent([]), 0.8, sampler.settings())[0])
  toks = np.asarray(jax.vmap(draw)(jax.random.split(jax.random.key(1), 20000)))
  freq = np.bincount(toks, minlength=16) / len(toks)
  ref = reference_probabilities(np.asarray(logits), [], sampler)
  assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(ref))
  np.testing.assert_allclose(freq, ref, atol=0.015)


def test_recent_keeps_the_last_ids():
  s = Sampler(repeat_penalty=1.1, repeat_last_n=4)
  np.testing.assert_array_equal(s.recent([1, 2]), [-1, -1, 1, 2])
  np.testing.assert_array_equal(s.recent([1, 2, 3, 4, 5, 6]), [3, 4, 5, 6])
  assert Sampler().recent([1, 2]).shape == (0,)  # no penalty: no history kept


@pytest.mark.parametrize(
  "kw",
  [
    dict(temperature=-1.0),
    dict(top_k=-1),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(min_p=2.0),
    dict(repeat_penalty=0.0),
  ],
)
def test_bad_settings(kw):
  with pytest.raises(ValueError, match="must be"):
    Sampler(**kw)


@pytest.mark.slow
def test_decode_loop_samples_as_the_chain_does():
  """A greedy decode with a strong penalty and top-k on the tiny qwen2 (whose greedy text
  repeats itself): each new token is the
  numpy chain's pick from the model's logits at that point, the penalty seeing the prompt and
  every token generated so far (the loop's history carried across its chunks)."""
  import q8rules

  path = Path(__file__).parent / "data" / "gguf_models" / "tiny-qwen2-q8_0.gguf"
  m = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
  sampler = Sampler(top_k=20, repeat_penalty=3.0, repeat_last_n=6)
  prompt = [1, 5, 9, 3]
  new = m.generate(prompt, 20, sampler=sampler)  # more than one chunk of the loop
  assert len(new) == 20
  ids = list(prompt)
  for t in new:
    want = reference_probabilities(m.logits(ids)[-1], ids, sampler).argmax()
    assert t == want, (ids, t, want)
    ids.append(t)
  plain = m.generate(prompt, 20)
  assert len(set(plain)) < 12 and new != plain  # the penalty changed a repeating greedy text


def primitives(settings: tuple, vocab: int = 49152) -> set[str]:
  """The primitives of one traced sampling step over a vocabulary of `vocab` (nested too)."""
  logits, recent = jnp.zeros((vocab,), jnp.float32), jnp.full((settings[-1],), -1, jnp.int32)
  jaxpr = jax.make_jaxpr(lambda x, k: sample(x, k, recent, 0.8, settings))(
    logits, jax.random.key(0)
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


def test_top_k_never_sorts_the_vocabulary():
  """With top-k, the step takes the k largest (`top_k`) and works on those: no sort of the
  vocabulary, and the draw's noise is over k, not the vocabulary; greedy runs no filter."""
  topk = primitives(Sampler(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05).settings())
  assert "top_k" in topk and "sort" not in topk
  assert "sort" not in primitives(Sampler(top_k=40, top_p=0.95).settings())  # greedy
  assert "sort" in primitives(Sampler(temperature=0.8, top_p=0.95).settings())  # top-p alone


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
  for row, index in zip(rows, want, strict=True):  # one row at a time, as the decode loop
    assert int(first_max(jnp.asarray(row))) == index
