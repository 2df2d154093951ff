"""The native CPU calls' thread limit: `q8rules.set_cpu_threads(n)` and `$Q8RULES_THREADS`.

What the limit promises on every backend: it is a setting of the native CPU library, so where
that library is unavailable (not x86-64, no compiler) there is nothing to limit and these
tests skip. Where it runs, a product that would take both CPUs of a 2-CPU process takes one
under a limit of 1, and its output is the same bit for bit (the work is cut by the problem,
not by the threads).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.kernels import cpu_native
from tests._utils import random_q8


@pytest.fixture(autouse=True)
def restore_limit():
  yield
  cpu_native._state.pop("threads", None)
  if cpu_native.available():
    cpu_native.library().Q8SetThreadLimit(0)


def needs_kernel():
  if not cpu_native.available():
    pytest.skip(f"the native CPU library is unavailable: {cpu_native.unavailable_reason()}")


def product(rng):
  q, scale = random_q8(rng, 1024, 1024)
  w = q8rules.Q8Array(q=q, scale=scale, axis=0)
  x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.float32)
  return np.asarray(q8rules.q8_matmul(x, w, implementation="cpu"))


def test_limit_caps_the_threads_and_keeps_the_bits():
  needs_kernel()
  cpus = len(os.sched_getaffinity(0))
  want = product(np.random.default_rng(0))
  unlimited = cpu_native.last_threads()
  assert 1 <= unlimited <= cpus
  q8rules.set_cpu_threads(1)
  assert cpu_native.max_threads() == 1 and cpu_native.cpus() == 1
  np.testing.assert_array_equal(product(np.random.default_rng(0)), want)
  assert cpu_native.last_threads() == 1
  q8rules.set_cpu_threads(None)
  assert cpu_native.max_threads() == cpus and cpu_native.thread_limit() is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_limits_are_refused(bad):
  with pytest.raises(ValueError, match="threads must be a positive integer"):
    q8rules.set_cpu_threads(bad)


@pytest.mark.slow
def test_environment_variable():
  needs_kernel()
  code = (
    "from q8rules.kernels import cpu_native; cpu_native.library();"
    " print(cpu_native.thread_limit(), cpu_native.max_threads())"
  )
  env = dict(os.environ, Q8RULES_THREADS="1")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["1", "1"]
  env["Q8RULES_THREADS"] = "many"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode != 0 and "$Q8RULES_THREADS='many' must be a positive integer" in out.stderr
