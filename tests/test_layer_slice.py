"""`LayerSlice` (q8rules.kernels.layer): a product on one layer of stacked Q8_0 weights, read in
place where the dispatcher picks the native CPU kernel and sliced first everywhere else; and
the decoder's in-place scan (`TransformerConfig.scan_in_place`) that uses it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.kernels import REGISTRY, q8_matmul, resolve_product, why_not
from q8rules.kernels.layer import LayerSlice, layer_of
from q8rules.kernels.native.library import TARGET, TARGET_LAYER
from q8rules.llm import load_gguf
from q8rules.llm.unstack import rebuilt
from q8rules.q8_0 import Q8Array
from tests._utils import close_to_float64, matrix, random_q8, random_x, rel_err, weight64

DATA = Path(__file__).parent / "data" / "gguf_models"
IDS = [0, 41, 70, 77, 77, 80, 222, 88]


def stacked_q8(rng, layers: int, k: int, n: int, scale_dtype) -> Q8Array:
  parts = [random_q8(rng, k, n, scale_dtype) for _ in range(layers)]
  return Q8Array(jnp.stack([q for q, _ in parts]), jnp.stack([s for _, s in parts]))


def runnable(m: int, k: int, n: int) -> list[str]:
  """The implementations that can run an (m, K) x (K, N) product on this backend (the
  dispatcher's say)."""
  return [name for name in REGISTRY if why_not(name, m, k, n, jnp.float32) is None]


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m,k,n", matrix([(1, 96, 40), (3, 256, 130), (17, 64, 7)], (17, 64, 7)))
def test_every_layer_matches_float64(rng, m, k, n, scale_dtype):
  w = stacked_q8(rng, 3, k, n, scale_dtype)
  x = random_x(rng, (m, k))
  for name in [None, *runnable(m, k, n)]:
    run = jax.jit(lambda x, i, name=name: q8_matmul(x, LayerSlice(w, i), implementation=name))
    for i in range(3):
      y = run(x, jnp.int32(i))
      assert y.shape == (m, n) and y.dtype == jnp.float32
      tol = 1e-2 if name and REGISTRY[name].rounds_weight else 1e-6
      assert close_to_float64(y, x, weight64(w.q[i], w.scale[i]), tol), (name, i)


def test_reads_in_place_where_the_dispatcher_picks_the_cpu_kernel(rng):
  """The compiled program passes the stacked values to the layer kernel (no slice of them)
  when `resolve` picks 'cpu' for this backend; elsewhere it slices the layer out first."""
  w = stacked_q8(rng, 4, 128, 64, np.float16)
  x = random_x(rng, (1, 128))
  hlo = (
    jax.jit(lambda x, i: q8_matmul(x, LayerSlice(w, i))).lower(x, jnp.int32(2)).compile().as_text()
  )
  sliced_q = [ln for ln in hlo.splitlines() if "dynamic-slice(" in ln and "s8[" in ln.split("=")[1]]
  if resolve_product(1, 128, 64, jnp.float32) == "cpu":
    assert f'custom_call_target="{TARGET_LAYER}"' in hlo
    assert f'custom_call_target="{TARGET}"' not in hlo
    assert sliced_q == [], sliced_q
  else:
    assert TARGET_LAYER not in hlo
    assert sliced_q, "the fallback slices the layer out"


def test_layer_index_out_of_range_is_refused(rng):
  w = stacked_q8(rng, 3, 64, 16, np.float16)
  x = random_x(rng, (1, 64))
  run = jax.jit(lambda x, i: q8_matmul(x, LayerSlice(w, i)))
  if resolve_product(1, 64, 16, jnp.float32) == "cpu":
    with pytest.raises(Exception, match=r"layer index 3 outside \[0, 3\)"):
      run(x, jnp.int32(3)).block_until_ready()
  else:  # the fallback's dynamic slice clamps: XLA's rule, not an error
    np.testing.assert_array_equal(run(x, jnp.int32(3)), run(x, jnp.int32(2)))


def test_bad_operands_are_named(rng):
  q, scale = random_q8(rng, 64, 16, np.float16)
  x = random_x(rng, (1, 64))
  with pytest.raises(ValueError, match=r"stacked values \(L, K, N\)"):
    q8_matmul(x, LayerSlice(Q8Array(q, scale), jnp.int32(0)))
  w = stacked_q8(rng, 2, 64, 16, np.float16)
  with pytest.raises(TypeError, match="integer scalar"):
    q8_matmul(x, LayerSlice(w, jnp.zeros((2,), jnp.int32)))
  with pytest.raises(ValueError, match="do not contract"):
    q8_matmul(random_x(rng, (1, 32)), LayerSlice(w, jnp.int32(0)))


def test_grad_and_vmap(rng):
  w = stacked_q8(rng, 3, 96, 24, np.float32)
  x = random_x(rng, (4, 2, 96))
  i = jnp.int32(1)
  q1, s1 = w.q[1], w.scale[1]
  got = jax.grad(lambda x: q8_matmul(x, LayerSlice(w, i)).sum())(x)
  want = np.broadcast_to(weight64(q1, s1).sum(axis=1), x.shape)  # ones (.., 24) @ W^T
  assert rel_err(got, want) < 1e-6
  batched = jax.vmap(lambda x: q8_matmul(x, LayerSlice(w, i)))(x)
  assert close_to_float64(batched.reshape(-1, 24), x.reshape(-1, 96), weight64(q1, s1), 1e-6)


def test_layer_of_indexes_every_leaf(rng):
  w = stacked_q8(rng, 3, 64, 8, np.float16)
  norm = jnp.asarray(rng.standard_normal((3, 8)).astype(np.float32))
  got = layer_of({"q": w, "norm": norm}, jnp.int32(2))
  assert isinstance(got["q"], LayerSlice) and got["q"].shape == (64, 8)
  np.testing.assert_array_equal(got["norm"], norm[2])
  np.testing.assert_array_equal(got["q"].take().q, w.q[2])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma3", marks=pytest.mark.heavy)])
def test_in_place_scan_gives_the_sliced_scans_logits(arch):
  """The decoder's in-place scan and nn.scan's slicing give the same logits and tokens (gemma3
  mixes local and global layers under lax.cond)."""
  m = load_gguf(DATA / f"tiny-{arch}-q8_0.gguf", dtype=jnp.float32)
  assert m.config.scan_layers and m.config.scan_in_place
  sliced = rebuilt(m, dataclasses.replace(m.config, scan_in_place=False))
  want, got = sliced.logits(IDS), m.logits(IDS)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
  assert m.generate(IDS, 8) == sliced.generate(IDS, 8)


@pytest.mark.slow
def test_in_place_scan_of_a_float_model():
  """Without quantization the in-place scan indexes float params: the same logits as nn.scan."""
  from q8rules.models.transformer import Transformer, TransformerConfig, init_cache

  config = TransformerConfig(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, head_dim=8, ffn=48)
  ids = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
  params = Transformer(config).init(jax.random.key(0), ids, init_cache(config, 8), 0)
  out = {
    flag: Transformer(dataclasses.replace(config, scan_in_place=flag)).apply(
      params, ids, init_cache(config, 8), 0
    )[0]
    for flag in (True, False)
  }
  np.testing.assert_allclose(out[True], out[False], rtol=1e-6, atol=1e-6)
