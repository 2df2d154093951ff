"""`load_gguf(..., mesh=)`: tensors go from the file to their shards (2 devices: on a CPU host
the forced host devices of tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from q8rules.checkpoint.assign import flatten
from q8rules.llm import load_gguf
from q8rules.q8_0 import Q8Array

DATA = Path(__file__).parent / "data" / "gguf_models"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_sharded_load_matches_single_device(arch):
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs 2 devices; the {jax.default_backend()} backend has {len(devices)}")
  path = DATA / f"tiny-{arch}-q8_0.gguf"
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,), devices=devices[:2])
  sharded = load_gguf(path, dtype=jnp.float32, mesh=mesh)
  flat = flatten(sharded.params)
  for name in ("layers.attn.q.kernel", "layers.attn.o.kernel", "layers.mlp.down.kernel"):
    a = flat[name]
    assert isinstance(a, Q8Array), name
    for part in (a.q, a.scale):
      local = {s.data.shape for s in part.addressable_shards}
      assert len(local) == 1 and len(part.addressable_shards) == 2, (name, local)
      assert part.sharding.shard_shape(part.shape) != part.shape, (name, "not split")
  single = load_gguf(path, dtype=jnp.float32)
  ids = [0, 41, 70, 77, 77, 80, 222, 88]
  want = single.logits(ids)
  got = sharded.logits(ids)
  err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  assert err < 1e-5, err
  assert sharded.generate(ids, 4) == single.generate(ids, 4)


def _mesh(n: int, axis_type) -> jax.sharding.Mesh:
  devices = jax.devices()
  if len(devices) < n:
    pytest.skip(f"needs {n} devices; the {jax.default_backend()} backend has {len(devices)}")
  return jax.make_mesh((n,), ("tp",), axis_types=(axis_type,), devices=devices[:n])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_explicit_mesh_matches_auto_and_single_device(arch):
  """`jax.make_mesh`'s default axes here are Explicit: the KV cache is made split like k / v
  (its update would be a ShardingTypeError against an unsplit cache)."""
  path = DATA / f"tiny-{arch}-q8_0.gguf"
  ids = [0, 41, 70, 77, 77, 80, 222, 88]
  single = load_gguf(path, dtype=jnp.float32)
  auto = load_gguf(path, dtype=jnp.float32, mesh=_mesh(2, AxisType.Auto))
  explicit = load_gguf(path, dtype=jnp.float32, mesh=_mesh(2, AxisType.Explicit))
  want, got = auto.logits(ids), explicit.logits(ids)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  ref = single.logits(ids)
  assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-5
  assert explicit.generate(ids, 4) == single.generate(ids, 4)


@pytest.mark.slow
def test_flax_rules_path_on_an_explicit_mesh():
  """The README's tensor-parallel path (quantize_model, shard_params, shard_products) on an
  Explicit mesh: with `init_cache` (placed on the mesh, replicated) or a cache split like k / v
  (`init_cache_on`), the logits are the unsharded ones."""
  import qwix
  from jax.sharding import PartitionSpec as P

  import q8rules
  from q8rules.llm.distributed import init_cache_on
  from q8rules.models import Transformer, TransformerConfig, init_cache
  from q8rules.sharding import shard_params

  mesh = _mesh(4, AxisType.Explicit)
  config = TransformerConfig(
    vocab=256, dim=128, layers=2, heads=4, kv_heads=4, head_dim=32, ffn=256
  )
  model = qwix.quantize_model(Transformer(config), q8rules.Q8Provider([q8rules.Q8Rule()]))
  tokens = jax.random.randint(jax.random.key(3), (1, 8), 0, config.vocab)
  params = model.init(jax.random.key(0), tokens, init_cache(config, 16))["params"]
  want, _ = jax.jit(model.apply)({"params": params}, tokens, init_cache(config, 16))
  specs = {
    r".*/attn/(q|k|v)/kernel": P(None, None, "tp"),
    r".*/attn/o/kernel": P(None, "tp", None),
    r".*/mlp/(gate|up)/kernel": P(None, None, "tp"),
    r".*/mlp/down/kernel": P(None, "tp", None),
  }
  sharded = shard_params(params, mesh, specs)
  for cache in (init_cache(config, 16), init_cache_on(config, 16, mesh)):
    with q8rules.shard_products(mesh, specs):
      got, (k, _) = jax.jit(model.apply)({"params": sharded}, tokens, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    assert k.sharding.spec == jax.typeof(cache[0]).sharding.spec or k.sharding.is_fully_replicated
