"""The `rng` fixture: fresh random data per test, seeded from its id (helpers: tests/_utils.py);
the `cpu_isa` fixture: each SIMD path of the native library this CPU can run, in turn.

Before any test module imports JAX, the CPU backend is given `HOST_DEVICES` devices, so the
multi-device tests (tests/test_sharding_mesh.py, tests/test_llm_gguf_mesh.py) run in this
process; everything else runs on the first (the default device), as with one.

The longest cases carry `@pytest.mark.slow` at the test, and the cases of a test's matrix
beyond its picks carry it through `tests/_utils.matrix`: the README's test command leaves them
out (pyproject's addopts) and `.ci/run` runs them next (`pytest -m slow`, printing the slowest
durations); CI's first step prints its own time against its 600 s budget. The README's command
runs in two pytest-xdist workers (`-n 2`): each is a process of its own, set up as above.
"""

from __future__ import annotations

import os
import zlib

import jax
import numpy as np
import pytest

from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd

HOST_DEVICES = 8
"""CPU devices in the test process (`jax_num_cpu_devices`; the CPU backend starts later)."""

jax.config.update("jax_num_cpu_devices", HOST_DEVICES)
# The suite does not read or write the user's JAX compilation cache (the CLI turns it on);
# tests/test_compile_cache.py runs the CLI with it on, in a temporary directory.
os.environ.setdefault("Q8RULES_NO_COMPILE_CACHE", "1")

ISA_ENV = "Q8RULES_CPU_ISA"
"""The native library's cap on its SIMD path (`cpu_isa` sets it)."""


@pytest.fixture
def rng(request) -> np.random.Generator:
  """A generator seeded from the test's name: fresh data per test, reproducible."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def float32_matmuls():
  """Plain-JAX float references at float32 precision on every backend (a GPU's default for
  float32 matmuls is TF32, about 1e-3 off). q8rules' own products are explicit without it:
  tests/test_precision.py checks that on the lowered program."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(params=native_simd.ladder())
def cpu_isa(request, monkeypatch) -> str:
  """One SIMD path of the native library, each in turn: every rung of this architecture's
  ladder (`native.simd.ladder()`: scalar, avx2, avx512 on x86-64; scalar, neon, neon_dotprod
  on aarch64) that this CPU can run, forced through `$Q8RULES_CPU_ISA` (read on every call);
  those it cannot run are skipped, naming the CPU's best. The test runs the native kernel."""
  if not native_lib.available():
    pytest.skip(f"native CPU kernel unavailable: {native_lib.unavailable_reason()}")
  name = request.param
  if name not in native_simd.supported():
    pytest.skip(f"this CPU has no {name} (best: {native_simd.isa('best')})")
  monkeypatch.setenv(ISA_ENV, name)
  return name
