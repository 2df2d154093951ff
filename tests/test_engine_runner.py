"""The engine's batched runner (`q8rules.engine.runner`, what `q8rules serve` runs): one program of several decode steps gives each
row the tokens of as many one-step programs, whatever rows decode beside it; a freed row stops."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.engine.runner import BatchRunner
from q8rules.engine.sampling import HISTORY, RowSettings, SamplingParams

DATA = Path(__file__).parent / "data" / "gguf_models"


@pytest.mark.slow
def test_several_steps_a_program_are_the_steps_one_at_a_time():
  m = q8rules.load_gguf(DATA / "tiny-qwen2-q8_0.gguf", dtype=jnp.float32, progress=False)
  prompts = [[1, 5, 7, 9, 11, 13], [2, 3, 4], [4, 8, 15, 16, 23]]
  params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7)]

  runner = BatchRunner(m, 3, 64, chunk=8, steps=4)  # one, its slots reused as the server does

  def tokens(schedule: list[int], rows: list[int]) -> list[list[int]]:
    for row in range(runner.slots):
      runner.free(row)
    out = [[] for _ in rows]
    for i, row in enumerate(rows):
      p = params[i % 2]
      runner.set_settings(row, p)
      ids = np.asarray(prompts[i], np.int32)
      first = runner.prefill(row, ids, 0, p.key(), np.full(HISTORY, -1, np.int32),
                             RowSettings.of([p]), True)  # fmt: skip
      out[i].append(int(first.fetch(False).tokens[0, 0]))
    for n in schedule:
      got = runner.decode(n).fetch(False).tokens
      for i, row in enumerate(rows):
        out[i].extend(int(t) for t in got[:n, row])
    return out

  one_at_a_time = tokens([1] * 8, [0, 1, 2])
  assert tokens([4, 4], [0, 1, 2]) == one_at_a_time
  assert tokens([3, 1, 2, 2], [2, 0, 1]) == one_at_a_time  # other slots, other counts
  alone = tokens([4, 1, 3], [1])
  assert alone == one_at_a_time[:1]


def test_a_freed_row_stops_and_the_others_go_on():
  """A freed row parks at the last position (where its dummy token lands on no prompt's: the
  slot's cache keeps its prefix), or at 0 on a model with sliding-window layers (whose ring
  keeps no prefix)."""
  ring = q8rules.load_gguf(DATA / "tiny-gemma3-q8_0.gguf", dtype=jnp.float32, progress=False)
  assert not BatchRunner(ring, 1, 64).keeps_prefixes
  m = q8rules.load_gguf(DATA / "tiny-qwen2-q8_0.gguf", dtype=jnp.float32, progress=False)
  runner = BatchRunner(m, 2, 64, chunk=8, steps=4)
  assert runner.keeps_prefixes
  greedy = RowSettings.of([SamplingParams(temperature=0.0)])
  for row in (0, 1):
    ids = np.asarray([3, 1, 4, 1, 5], np.int32)
    runner.prefill(row, ids, 0, np.zeros(2, np.uint32), np.full(HISTORY, -1, np.int32), greedy,
                   True)  # fmt: skip
  runner.decode(2)
  runner.free(1)
  rows = runner.rows
  assert np.asarray(rows.positions).tolist() == [7, 63]
  assert np.asarray(rows.active).tolist() == [True, False]
  runner.decode(3)
  assert np.asarray(runner.rows.positions).tolist() == [10, 63]


@pytest.mark.slow
def test_warm_up_compiles_every_program_without_running_them():
  """After `warm_up` a request's programs (its prompt's chunks, the decode steps, the slot's
  release, its key) compile nothing more, and the warm-up ran none of them: the cache and the
  rows are the arrays they were (not donated)."""
  from q8rules.llm import compile_cache

  m = q8rules.load_gguf(DATA / "tiny-qwen2-q8_0.gguf", dtype=jnp.float32, progress=False)
  runner = BatchRunner(m, 2, 64, chunk=8, steps=4)
  cache, rows = runner.cache, runner.rows

  def compiles() -> int:
    s = compile_cache.stats()
    return s["compiled"] + s["cache_hits"]

  start = compiles()
  runner.warm_up()
  assert runner.cache is cache and runner.rows is rows
  assert not any(a.is_deleted() for a in jax.tree.leaves((cache, rows)))
  before = compiles()
  assert before > start
  p = SamplingParams(temperature=0.9, top_k=20, seed=7)
  ids = np.arange(1, 14, dtype=np.int32)  # 13 tokens: chunks of 8, 4 and 1
  runner.set_settings(1, p)
  pos = 0
  for i, t in enumerate(chunks := [8, 4, 1]):
    last = i == len(chunks) - 1
    step = runner.prefill(1, ids[pos : pos + t], pos, p.key(), np.full(HISTORY, -1, np.int32),
                          RowSettings.of([p]), last)  # fmt: skip
    assert (step is not None) == last  # a chunk before the last samples nothing
    jax.block_until_ready(runner.rows if step is None else step.fetch(True))
    pos += t
  for n in (1, 4, 2):
    runner.decode(n).fetch(logprobs=True)
  runner.free(1)
  jax.block_until_ready(runner.rows)
  assert compiles() == before
