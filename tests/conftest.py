"""Shared test helpers: float64 references and fresh random data."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64."""
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture
def rng(request) -> np.random.Generator:
  """A generator seeded from the test's name: fresh data per test, reproducible."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
