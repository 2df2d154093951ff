"""q8rules.llm.unstack.unrolled: the scanned GGUF model with its layers unrolled gives the
same logits (to float32 rounding) and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm import load_gguf
from q8rules.llm.unstack import unrolled

DATA = Path(__file__).parent / "data" / "gguf_models"
IDS = [0, 41, 70, 77, 77, 80, 222, 88]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_unrolled_matches_scanned(arch):
  m = load_gguf(DATA / f"tiny-{arch}-q8_0.gguf", dtype=jnp.float32)
  u = unrolled(m)
  assert m.config.scan_layers and not u.config.scan_layers
  assert "layers" not in u.params and f"layers_{m.config.layers - 1}" in u.params
  want, got = m.logits(IDS), u.logits(IDS)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert u.generate(IDS, 12) == m.generate(IDS, 12)
  assert unrolled(u) is u and m.unrolled().config == u.config
