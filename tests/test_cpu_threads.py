"""The native CPU calls' threads: the limit (`q8rules.set_cpu_threads(n)`, `$Q8RULES_THREADS`)
and the library's helper threads (`$Q8RULES_SPIN_US`).

What the limit promises on every backend: it is a setting of the native CPU library, so where
that library is unavailable (neither x86-64 nor aarch64, no compiler) there is nothing to limit
and these tests skip. Where it runs, a product that would take both CPUs of a 2-CPU process
takes one under a limit of 1, and its output is the same bit for bit (the work is cut by the
problem, not by the threads). On a GPU or TPU host the products run on the host's CPU devices (the
library serves programs lowered for the CPU), so every backend expects the same.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import q8rules
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import settings as native_settings
from q8rules.kernels.native import threads as native_threads
from tests._utils import random_q8


@pytest.fixture(autouse=True)
def on_a_cpu_device_then_no_limit():
  with jax.default_device(jax.devices("cpu")[0]):
    yield
  native_settings.forget_limit()
  if native_lib.available():
    native_lib.library().Q8SetThreadLimit(0)


def needs_kernel():
  if not native_lib.available():
    pytest.skip(f"the native CPU library is unavailable: {native_lib.unavailable_reason()}")


def product(rng):
  q, scale = random_q8(rng, 1024, 1024)
  w = q8rules.Q8Array(q=q, scale=scale, axis=0)
  x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.float32)
  return np.asarray(q8rules.q8_matmul(x, w, implementation="cpu"))


def test_limit_caps_the_threads_and_keeps_the_bits():
  needs_kernel()
  cpus = len(os.sched_getaffinity(0))
  want = product(np.random.default_rng(0))
  unlimited = native_threads.last_threads()
  assert 1 <= unlimited <= cpus
  q8rules.set_cpu_threads(1)
  assert native_threads.max_threads() == 1 and native_threads.cpus() == 1
  np.testing.assert_array_equal(product(np.random.default_rng(0)), want)
  assert native_threads.last_threads() == 1
  q8rules.set_cpu_threads(None)
  assert native_threads.max_threads() == cpus and native_settings.thread_limit() is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_limits_are_refused(bad):
  with pytest.raises(ValueError, match="threads must be a positive integer"):
    q8rules.set_cpu_threads(bad)


@pytest.mark.slow
def test_environment_variable():
  needs_kernel()
  code = (
    "from q8rules.kernels.native import library as native_lib, settings as native_settings,"
    " threads as native_threads; native_lib.library();"
    " print(native_settings.thread_limit(), native_threads.max_threads())"
  )
  env = dict(os.environ, Q8RULES_THREADS="1")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["1", "1"]
  env["Q8RULES_THREADS"] = "many"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode != 0 and "$Q8RULES_THREADS='many' must be a positive integer" in out.stderr


def test_concurrent_callers_keep_the_bits(rng):
  """Products called from several XLA threads at once (a shard_map over 4 of the host's CPU
  devices, each device's program calling the kernel): callers that find the library's helpers
  busy take threads of XLA's pool instead; every output is one lone call's, bit for bit."""
  needs_kernel()
  devices = jax.devices("cpu")
  if len(devices) < 4:
    pytest.skip(f"needs 4 CPU devices; this process has {len(devices)}")
  q, scale = random_q8(rng, 1024, 1024)
  w = q8rules.Q8Array(q=q, scale=scale, axis=0)
  xs = jnp.asarray(rng.standard_normal((4, 1, 1024)), jnp.float32)
  want = [np.asarray(q8rules.q8_matmul(x, w, implementation="cpu")) for x in xs]
  assert native_threads.last_threads() == min(2, native_threads.max_threads())
  mesh = jax.make_mesh((4,), ("d",), devices=devices[:4])
  per_device = jax.jit(
    jax.shard_map(
      lambda x: q8rules.q8_matmul(x[0], w, implementation="cpu")[None],
      mesh=mesh, in_specs=P("d"), out_specs=P("d"),
    )
  )  # fmt: skip
  placed = jax.device_put(xs, NamedSharding(mesh, P("d")))
  for _ in range(20):
    got = np.asarray(per_device(placed))
    for i in range(4):
      np.testing.assert_array_equal(got[i], want[i])


SPIN_CODE = """
import jax, jax.numpy as jnp, numpy as np, q8rules
from q8rules.kernels.native import settings as native_settings
from q8rules.kernels.native import threads as native_threads
from tests._utils import random_q8
jax.config.update("jax_default_device", jax.devices("cpu")[0])
q, scale = random_q8(np.random.default_rng(0), 1024, 1024)
x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 1024)), jnp.float32)
w = q8rules.Q8Array(q=q, scale=scale, axis=0)
y = [np.asarray(q8rules.q8_matmul(x[i:i + 1], w, implementation="cpu")) for i in range(3)]
print(native_settings.spin_us(), native_threads.last_threads(), np.concatenate(y).tobytes().hex())
"""


@pytest.mark.slow
def test_spin_time_variable():
  """`$Q8RULES_SPIN_US`: how long a helper spins for its next product (0: it sleeps at once);
  the outputs are the same bits whatever it is. A value that is not a non-negative integer is
  refused, naming the variable."""
  needs_kernel()
  outs = {}
  for value in ("", "0", "5000"):
    env = dict(os.environ, Q8RULES_SPIN_US=value)
    out = subprocess.run([sys.executable, "-c", SPIN_CODE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    outs[value] = out.stdout.split()
  assert [outs[v][0] for v in outs] == [str(native_settings.DEFAULT_SPIN_US), "0", "5000"]
  assert len({o[1] for o in outs.values()}) == 1 and len({o[2] for o in outs.values()}) == 1
  env = dict(os.environ, Q8RULES_SPIN_US="-1")
  out = subprocess.run([sys.executable, "-c", SPIN_CODE], env=env, capture_output=True, text=True)
  assert out.returncode != 0
  assert "$Q8RULES_SPIN_US='-1' must be a non-negative integer" in out.stderr
