"""The `rng` fixture: fresh random data per test, seeded from its id (helpers: tests/_utils.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
  """A generator seeded from the test's name: fresh data per test, reproducible."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
