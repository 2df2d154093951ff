"""The rules on a decoder with N-D weights (DenseGeneral 'BTD,DNH->BTNH', Einsum 'BTNH,NHD->BTD')."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import q8rules
from tests._utils import rel_err
from tests.einsum_decoder import Decoder, DecoderConfig, init_cache

CONFIG = DecoderConfig(vocab=128, dim=64, layers=2, heads=2, head_dim=32, ffn=96, max_len=8)


def _setup():
  model = Decoder(CONFIG)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab, (1, 6)), jnp.int32)
  cache = init_cache(CONFIG)
  float_params = model.init(jax.random.key(3), tokens, cache, 0)["params"]
  return model, tokens, cache, float_params


@pytest.mark.slow
@pytest.mark.heavy
def test_nd_weights_served_as_q8_0():
  """q/k/v (D, N, H) and o (N, H, D) become (D, N*H) and (N*H, D) Q8 matrices; the served
  logits are Q8_0's error away from float, equal to QAT's forward, and init-time
  quantization is bit-equal to `quantize_params`."""
  model, tokens, cache, float_params = _setup()
  rules = [q8rules.Q8Rule()]
  provider = q8rules.Q8Provider(rules)
  q8_model = qwix.quantize_model(model, provider)
  abstract = jax.eval_shape(q8_model.init, jax.random.key(3), tokens, cache, 0)["params"]
  q8_params = q8rules.quantize_params(float_params, abstract)
  init_params = q8_model.init(jax.random.key(3), tokens, cache, 0)["params"]
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), q8_params, init_params)
  assert all(jax.tree.leaves(same))
  q = q8_params["layers_0"]["attn"]["q"]["kernel"].array
  o = q8_params["layers_0"]["attn"]["o"]["kernel"].array
  assert q.shape == (64, 2 * 32) and o.shape == (2 * 32, 64)

  served, _ = jax.jit(q8_model.apply)({"params": q8_params}, tokens, cache, 0)
  ref, _ = model.apply({"params": float_params}, tokens, cache, 0)
  assert 1e-4 < rel_err(served, ref) < 3e-2

  qat_model = qwix.quantize_model(model, q8rules.Q8QatProvider(rules))
  qat, _ = jax.jit(qat_model.apply)({"params": float_params}, tokens, cache, 0)
  assert rel_err(qat, served) < 1e-5

  paths = provider.report().paths()
  assert paths["layers_0/attn/q/dot_general0"] != "float"
  assert paths["layers_0/attn/o/einsum0"] != "float"
  assert paths["layers_0/attn/einsum0"] == "float"  # scores: two activations
