"""`Q8Provider.shapes_only`: the quantized init's param shapes without tracing the quantizer,
the same tree, shapes and dtypes as the real quantized init gives (what `load_gguf` uses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from q8rules import Q8Provider, Q8Rule
from q8rules.models.transformer import Transformer, TransformerConfig, init_cache


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
def test_shapes_only_gives_the_quantized_inits_shapes(scan_layers, scale_dtype):
  config = TransformerConfig(
    vocab=96, dim=40, layers=2, heads=4, kv_heads=2, head_dim=10, ffn=72, scan_layers=scan_layers
  )  # dim 40: K padded to 64 in the Q8 matrices
  provider = Q8Provider([Q8Rule(module_path=".*", scale_dtype=scale_dtype)])
  model = qwix.quantize_model(Transformer(config), provider)
  args = (jax.random.key(0), jnp.zeros((1, 1), jnp.int32), init_cache(config, 1), 0)
  want = jax.eval_shape(model.init, *args)
  with provider.shapes_only():
    got = jax.eval_shape(model.init, *args)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert (g.shape, np.dtype(g.dtype)) == (w.shape, np.dtype(w.dtype))
  # outside the context the provider quantizes again: real values, not zeros
  params = model.init(*args)["params"]
  q = (
    params["layers"]["mlp"]["up"]["kernel"]
    if scan_layers
    else params["layers_0"]["mlp"]["up"]["kernel"]
  )
  assert np.abs(np.asarray(q.array.q)).max() > 0
