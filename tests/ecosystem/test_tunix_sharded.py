"""Tunix's models on a device mesh by their own sharding annotations, quantized.

Tunix annotates every param (`nnx.Param(..., sharding=('fsdp', 'tp', None))`). The Q8 params
carry those annotations over as 2-D (K, N) specs, so Tunix's own way of sharding a model
(`nnx.get_named_sharding` of its state, `jax.device_put`) places the int8 values and scales,
and the sharded model computes what the unsharded one does.

Needs 4 devices: tests/conftest.py gives the CPU backend 8 (`jax_num_cpu_devices`), so this
runs in the same process as the rest of the matrix.
"""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
import qwix
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import q8rules
from tests._utils import rel_err
from tests.ecosystem import tunix_checks as tc
from tests.ecosystem import tunix_models as tm

pytestmark = [
  pytest.mark.ecosystem,
  pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="needs google-tunix"),
]

AXES = ("fsdp", "tp")
F32_CASES = [c for c in tm.CASES if c.dtype == "float32"]


def _mesh() -> jax.sharding.Mesh:
  if jax.device_count() < 4:
    pytest.skip(f"needs 4 devices, found {jax.device_count()} (tests/conftest.py sets 8 on CPU)")
  return jax.make_mesh((2, 2), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])


@pytest.mark.parametrize("case", F32_CASES, ids=[c.id for c in F32_CASES])
def test_sharded_by_its_own_annotations_equals_unsharded(case):
  mesh = _mesh()
  with tc.tunix_flags():
    model = tm.build(case, np.random.default_rng(7))
    args = tm.inputs()
    with jax.set_mesh(mesh):  # quantized under the mesh: K splits are checked here
      q8 = qwix.quantize_model(model, q8rules.Q8Provider([q8rules.Q8Rule()]), *args)
    unsharded = tc.jit_forward(q8, args)
    state = nnx.state(q8)
    with jax.set_mesh(mesh):
      nnx.update(q8, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
      sharded = tc.jit_forward(q8, args)
  assert rel_err(sharded, unsharded) <= 1e-6
  q = q8.embedder.input_embedding.array.q[...]  # (K = dim, N = vocab), annotated ('tp', 'fsdp')
  assert tuple(q.sharding.spec) == ("fsdp", "tp")
  assert q.addressable_shards[0].data.shape == (tm.DIM // 2, tm.VOCAB // 2)


def test_a_k_split_cutting_a_block_is_refused_naming_the_param():
  case = F32_CASES[0]
  mesh = AbstractMesh((4, 1), AXES, axis_types=(AxisType.Auto,) * 2)  # 16 of K = 64 rows each
  with tc.tunix_flags():
    model = tm.build(case, np.random.default_rng(7))
    with (
      jax.sharding.use_abstract_mesh(mesh),
      pytest.raises(ValueError, match=r"^embedder/input_embedding: cannot split K=64 rows"),
    ):
      qwix.quantize_model(model, q8rules.Q8Provider([q8rules.Q8Rule()]), *tm.inputs())
