"""q8rules.timing: the median timer of the demo and the benchmarks."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from q8rules.timing import call_times, median_time, timed_call


def test_warm_up_calls_are_made_and_not_timed():
  calls = []

  def fn(a, b):
    calls.append((a, b))
    return jnp.asarray(a + b)

  times = call_times(fn, 1, 2, warmup=2, reps=3)
  assert calls == [(1, 2)] * 5
  assert len(times) == 3 and all(t >= 0 for t in times)


def test_rotate_passes_the_next_item_to_each_call():
  calls = []
  call_times(lambda *a: calls.append(a), "x", warmup=2, reps=3, rotate=[0, 1, 2])
  assert calls == [("x", 0), ("x", 1), ("x", 2), ("x", 0), ("x", 1)]


def test_a_time_covers_the_call():
  assert median_time(time.sleep, 0.02, warmup=0, reps=3) >= 0.02


def test_the_timer_waits_for_the_computation():
  """JAX dispatches asynchronously (on CPU too): the timed call returns a result already
  computed, and its time is at least that of a computation waited for."""
  f = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda i, b: jnp.tanh(b @ a), a))
  a = jnp.full((512, 512), 1 / 512, jnp.float32)
  jax.block_until_ready(f(a))
  out, seconds = timed_call(f, a)
  assert out.is_ready()
  start = time.perf_counter()
  f(a).block_until_ready()
  waited = time.perf_counter() - start
  assert seconds >= 0.2 * waited, (seconds, waited)


def test_a_result_without_arrays_is_returned_as_it_is():
  out, seconds = timed_call(lambda: None)
  assert out is None and seconds >= 0


@pytest.mark.parametrize(
  "kwargs, words",
  [
    ({"reps": 0}, "reps must be an int >= 1"),
    ({"reps": 2.0}, "reps must be an int >= 1"),
    ({"warmup": -1}, "warmup must be an int >= 0"),
    ({"warmup": True}, "warmup must be an int >= 0"),
    ({"rotate": []}, "rotate must hold at least one item"),
  ],
)
def test_bad_counts_raise(kwargs, words):
  with pytest.raises(ValueError, match=words):
    median_time(lambda: None, **kwargs)
