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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_load_matches_single_device(arch):
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs 2 devices; the {jax.default_backend()} backend has {len(devices)}")
  path = DATA / f"tiny-{arch}-q8_0.gguf"
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,), devices=devices[:2])
  sharded = load_gguf(path, dtype=jnp.float32, mesh=mesh)
  flat = flatten(sharded.params)
  for name in ("layers_0.attn.q.kernel", "layers_0.attn.o.kernel", "layers_0.mlp.down.kernel"):
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
