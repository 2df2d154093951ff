"""The `rng` fixture: fresh random data per test, seeded from its id (helpers: tests/_utils.py)."""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest


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
