"""q8rules.llm.unstack.unrolled: the scanned GGUF model with its layers unrolled gives the
same logits (to float32 rounding) and the same greedy tokens, quantized as the scanned model
was (fake quant for a QAT model, Q8_0 activations where asked)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm import load_gguf
from q8rules.llm.unstack import unrolled
from q8rules.models import Transformer
from q8rules.providers import Q8QatProvider
from tests._utils import rel_err

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


def _perturbed(params):
  """params with every float leaf moved off its Q8_0 grid (a QAT model's, as if trained)."""
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda p: p + 1e-3 * rng.standard_normal(p.shape).astype(p.dtype), params)


@pytest.mark.slow
def test_unrolled_qat_model_keeps_fake_quant():
  """A `trainable='qat'` model unrolled is quantized by Q8QatProvider with the same modules:
  on params off the Q8_0 grid its logits are the scanned QAT model's, not a float model's."""
  qat = load_gguf(DATA / "tiny-llama-q8_0.gguf", dtype=jnp.float32, trainable="qat")
  trained = dataclasses.replace(qat, params=_perturbed(qat.params))
  u = trained.unrolled()
  assert u.provider_type is Q8QatProvider and u.rule is not None
  want, got = trained.logits(IDS), u.logits(IDS)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  plain = dataclasses.replace(u, model=Transformer(u.config))  # the same params, no fake quant
  assert rel_err(plain.logits(IDS), want) > 1e-4, "the check must tell fake quant apart"


def test_unrolled_keeps_act_qtype():
  m = load_gguf(DATA / "tiny-llama-q8_0.gguf", dtype=jnp.float32, act_qtype="q8_0")
  u = m.unrolled()
  assert m.rule.act_qtype == "q8_0" and u.rule.act_qtype == "q8_0"
  want, got = m.logits(IDS), u.logits(IDS)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
