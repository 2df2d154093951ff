"""q8rules.llm.generate: the decode on the engine runner gives the tokens of a host loop (one
jitted model call per token, sampling in eager JAX), greedy and sampled, across chunks and
with stop ids."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm import load_gguf
from q8rules.llm.generate import CHUNK
from tests._utils import rel_err

DATA = Path(__file__).parent / "data" / "gguf_models"


@pytest.fixture(scope="module")
def m():
  return load_gguf(DATA / "tiny-llama-q8_0.gguf", dtype=jnp.float32)


def host_loop(m, prompt, n, temperature=0.0, seed=0, stop_ids=()):
  """The host loop GGUFModel.stream ran before the device loop (after the same prefill)."""
  t = len(prompt)
  last, cache = m.prefill(prompt, n)
  key = jax.random.key(seed)
  out = []
  for i in range(n):
    if temperature > 0:
      key, sub = jax.random.split(key)
      nxt = int(jax.random.categorical(sub, last / temperature))
    else:
      nxt = int(jnp.argmax(last))
    out.append(nxt)
    if nxt in stop_ids or i == n - 1:
      return out
    logits, cache = m._run(jnp.asarray([[nxt]], jnp.int32), cache, t + i)
    last = logits[0, -1]
  return out


PROMPT = [0, 41, 70, 77, 77, 80]


@pytest.mark.slow
def test_prefill_runs_the_head_on_the_last_position_only(m):
  """`prefill` (what `stream` runs on the prompt) gives the last row of `logits` and, bit for
  bit, the cache of the full pass; the model called with `last_only` returns that one row."""
  last, cache = m.prefill(PROMPT, 4)
  assert last.shape == (m.config.vocab,)
  assert rel_err(last, m.logits(PROMPT)[-1]) <= 1e-6
  tokens = jnp.asarray(PROMPT, jnp.int32)[None]
  full, full_cache = m._run(tokens, m._cache(len(PROMPT) + 4), 0)
  assert rel_err(last, full[0, -1]) <= 1e-6
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(full_cache), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out, _ = m.model.apply(
    {"params": m.params}, tokens, m._cache(len(PROMPT)), jnp.int32(0), last_only=True
  )
  assert out.shape == (1, 1, m.config.vocab)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.9, marks=pytest.mark.slow)])
def test_device_loop_matches_host_loop(m, temperature):
  n = 2 * CHUNK + 3  # three device calls, the last one short
  want = host_loop(m, PROMPT, n, temperature, seed=3)
  assert m.generate(PROMPT, n, temperature=temperature, seed=3) == want
  assert len(want) == n


def test_stop_ids_inside_a_chunk(m):
  full = host_loop(m, PROMPT, CHUNK + 5, 0.9, seed=1)
  stop = full[CHUNK // 2 + 1]  # a token the loop meets inside its first chunk
  got = m.generate(PROMPT, CHUNK + 5, temperature=0.9, seed=1, stop_ids=[stop])
  assert got == full[: full.index(stop) + 1]


def test_short_runs(m):
  assert m.generate(PROMPT, 1) == host_loop(m, PROMPT, 1)
  assert m.generate(PROMPT, 0) == []


def test_repeated_calls_compile_nothing(m):
  """`stream` decodes on a runner kept on the model per context size: a second call of the
  same prompt length and context, with other settings and another prompt, compiles nothing."""
  from q8rules.llm import compile_cache

  m.generate(PROMPT, 5, temperature=0.9, seed=1)
  before = compile_cache.stats()
  got = m.generate(PROMPT[::-1], 7, temperature=0.5, seed=2)
  after = compile_cache.stats()
  assert len(got) == 7
  assert after["compiled"] + after["cache_hits"] == before["compiled"] + before["cache_hits"]


@pytest.mark.slow
def test_a_long_penalty_window_sees_the_whole_prompt(m):
  """`penalty_last_n` beyond the runner's default history (`HISTORY` ids) keeps that many:
  greedy with a repeat penalty over the last 200 ids of a 100-token prompt gives the tokens of
  a host loop that penalizes every id of the prompt and of the reply (logits from full passes)."""
  from q8rules.engine.sampling import HISTORY, SamplingParams

  rng = np.random.default_rng(0)
  prompt = rng.integers(1, m.config.vocab, 100).tolist()
  assert len(prompt) > HISTORY
  params = SamplingParams(temperature=0.0, repeat_penalty=4.0, penalty_last_n=200)
  want, ids = [], list(prompt)
  for _ in range(6):
    logits = np.asarray(m.logits(ids)[-1], np.float64)
    seen = np.unique(ids[-200:])
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / 4.0, logits[seen] * 4.0)
    want.append(int(np.argmax(logits)))
    ids.append(want[-1])
  assert m.generate(prompt, 6, sampler=params) == want
