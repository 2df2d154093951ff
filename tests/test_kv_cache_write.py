"""The decoder's KV cache writes (`q8rules.models.attention`): a 16-bit float cache is written
on its bits, so the write is exact and no compiled step updates a cache in float32 (XLA:CPU
did that for a bfloat16 slice update: each layer's write converted every layer's cache to
float32 and back)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from q8rules.models import Transformer, TransformerConfig, init_cache
from q8rules.models.attention import _global_write, _local_write

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _np(dtype):
  return {jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16, jnp.float32: np.float32}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_write_is_exact(rng, dtype):
  """A chunk of 3 positions written at layer 1, position 4 of a (L, B, S, KV, H) cache: those
  entries are the chunk cast to the cache's dtype, every other entry keeps its bits."""
  shape = (3, 2, 10, 2, 8)
  caches = tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
  new = [rng.standard_normal((2, 3, 2, 8)).astype(np.float32) for _ in range(2)]
  out = jax.jit(lambda p, k, v: _global_write(p, k, v, 1, 4))(caches, *map(jnp.asarray, new))
  for cache, chunk, got in zip(caches, new, out, strict=True):
    want = np.asarray(cache).copy()
    want[1, :, 4:7] = chunk.astype(_np(dtype))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_local_write_is_exact(rng, dtype):
  """A ring of 4 slots: 6 new positions from position 9 keep the last 4, at (9 + 2 + i) % 4."""
  shape = (2, 1, 4, 2, 8)
  caches = tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
  new = [rng.standard_normal((1, 6, 2, 8)).astype(np.float32) for _ in range(2)]
  out = jax.jit(lambda p, k, v: _local_write(p, k, v, 0, 9))(caches, *map(jnp.asarray, new))
  for cache, chunk, got in zip(caches, new, out, strict=True):
    want = np.asarray(cache).copy()
    for i in range(4):
      want[0, :, (9 + 2 + i) % 4] = chunk[:, 2 + i].astype(_np(dtype))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def _compiled_step(rng, dtype, donate: bool) -> tuple[str, dict]:
  """The compiled one-token decode step (its HLO text) of a scanned model with global and
  sliding-window layers whose activations are `dtype`, and its cache; `donate`: the cache is
  donated, as the decode loop donates it."""
  config = TransformerConfig(
    vocab=64,
    dim=32,
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=8,
    ffn=64,
    dtype=dtype,
    local_layers=(True, False, True, False),
    sliding_window=4,
  )
  model = Transformer(config)
  tokens = jnp.asarray(rng.integers(0, 64, (1, 5)), jnp.int32)
  cache = init_cache(config, 16)
  params = model.init(jax.random.key(0), tokens, cache)
  step = jnp.zeros((1, 1), jnp.int32)
  apply = jax.jit(model.apply, donate_argnums=(2,) if donate else ())
  return apply.lower(params, step, cache, jnp.int32(5)).compile().as_text(), cache


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_decode_step_updates_the_cache_at_its_own_width(rng, dtype):
  """The compiled decode step of a 16-bit model (global and sliding-window layers), on whatever
  backend runs the tests, updates each cache (a dynamic-update-slice or a scatter of a whole
  cache's shape) on 16-bit values, never on float32 ones."""
  text, cache = _compiled_step(rng, dtype, donate=False)
  shapes = {tuple(a.shape) for a in jax.tree.leaves(cache)}
  assert shapes == {(2, 1, 16, 2, 8), (2, 1, 4, 2, 8)}
  for s in shapes:
    dims = ",".join(map(str, s))
    updates = re.findall(rf"= (\w+)\[{dims}\]\S* (?:dynamic-update-slice|scatter)\(", text)
    assert updates and "f32" not in updates, (s, updates)


@pytest.mark.slow
def test_a_decode_step_copies_no_cache(rng):
  """The compiled one-token step of a scanned float32 model with global and sliding-window
  layers, its cache donated, updates every cache in place: no copy of a whole cache. This holds
  only if each ring is written before it is read (a read that is no input of the write cannot
  be ordered before an in-place update, so XLA copies the ring)."""
  text, cache = _compiled_step(rng, jnp.float32, donate=True)
  for shape in {tuple(a.shape) for a in jax.tree.leaves(cache)}:
    dims = ",".join(map(str, shape))
    assert not re.findall(rf"= \w+\[{dims}\]\S* copy\(", text), shape
