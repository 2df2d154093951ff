"""Tensor-parallel Q8_0 (`q8rules.sharding`) without devices: spec translation and the errors
for bad splits, on `AbstractMesh`es. The products on several devices are in
tests/test_sharding_mesh.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from q8rules import sharding
from q8rules.layout import WeightLayout
from q8rules.q8_0 import quantize

# ---- no devices needed -------------------------------------------------------------

TP2 = AbstractMesh((2,), ("tp",))
TP8 = AbstractMesh((8,), ("tp",))
DP_TP = AbstractMesh((2, 4), ("dp", "tp"))


def test_k_split_cutting_a_block_is_refused_with_shape_and_devices():
  with pytest.raises(ValueError) as e:
    sharding.check_q8_spec((96, 64), P("tp", None), TP2)
  msg = str(e.value)
  assert "K=96" in msg and "(96, 64)" in msg and "2 devices" in msg and "48 rows" in msg


def test_k_split_into_whole_blocks_is_accepted():
  assert sharding.check_q8_spec((128, 64), P("tp"), TP2) == P("tp", None)
  assert sharding.check_q8_spec((512, 64), P(("dp", "tp"), None), DP_TP) == P(("dp", "tp"), None)
  with pytest.raises(ValueError, match=r"K=192 .* over 8 devices .*: 24 rows per device"):
    sharding.check_q8_spec((192, 64), P(("dp", "tp"), None), DP_TP)


def test_n_split_must_divide():
  with pytest.raises(ValueError, match="N=100 .* over 8 devices"):
    sharding.check_q8_spec((64, 100), P(None, "tp"), TP8)
  assert sharding.check_q8_spec((64, 320), P(None, "tp"), TP8) == P(None, "tp")


def test_bad_specs():
  with pytest.raises(ValueError, match="mesh axis 'model' is not in the mesh"):
    sharding.check_q8_spec((64, 64), P(None, "model"), TP2)
  with pytest.raises(ValueError, match="used twice"):
    sharding.check_q8_spec((64, 64), P("tp", "tp"), TP2)
  with pytest.raises(ValueError, match="3 entries for 2 axes"):
    sharding.check_q8_spec((64, 64), P(None, None, "tp"), TP2)
  with pytest.raises(TypeError, match="PartitionSpec"):
    sharding.check_q8_spec((64, 64), ("tp", None), TP2)


def test_stacked_layers_keep_their_leading_spec():
  assert sharding.check_q8_spec((4, 64, 64), P(None, None, "tp"), TP2) == P(None, None, "tp")
  with pytest.raises(ValueError, match="leading axis 0 of size 3"):
    sharding.check_q8_spec((3, 64, 64), P("tp"), TP2)


def test_q8_sharding_gives_q_and_scale_the_same_spec():
  a = quantize(jnp.ones((64, 48), jnp.float32), scale_dtype=jnp.float16)
  mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
  s = sharding.q8_sharding(mesh, P(None, "tp"), like=a)
  assert s.q.spec == s.scale.spec == P(None, "tp")
  assert jax.tree.structure(s) == jax.tree.structure(a)
  placed = sharding.shard_q8(a, mesh, P(None, "tp"))
  assert placed.q.sharding.spec == P(None, "tp") and placed.scale.dtype == jnp.float16
  with pytest.raises(ValueError, match="K=96"):
    sharding.q8_sharding(TP2, P("tp"), like=quantize(jnp.ones((96, 8), jnp.float32)))


@pytest.mark.parametrize(
  ("shape", "contract", "free", "spec", "want"),
  [
    ((64, 256), (0,), (1,), P(None, "tp"), P(None, "tp")),  # Dense, column
    ((256, 64), (0,), (1,), P("tp", None), P("tp", None)),  # Dense, row
    ((64, 4, 32), (0,), (1, 2), P(None, "tp", None), P(None, "tp")),  # q/k/v by head
    ((4, 32, 64), (0, 1), (2,), P("tp", None, None), P("tp", None)),  # attention out by head
    ((1, 4, 32, 64), (0, 1, 2), (3,), P(None, "tp"), P("tp", None)),  # a unit axis first
    ((64, 256), (0,), (1,), P(), P(None, None)),
  ],
)
def test_float_spec_carries_through_the_layout(shape, contract, free, spec, want):
  assert sharding.q8_spec_for_layout(WeightLayout(shape, contract, free), spec) == want


def test_float_spec_that_is_not_a_contiguous_split_is_refused():
  heads = WeightLayout((64, 4, 32), (0,), (1, 2))
  with pytest.raises(ValueError, match="not the leading axis"):
    sharding.q8_spec_for_layout(heads, P(None, None, "tp"))  # head_dim: strided columns
  with pytest.raises(ValueError, match="several axes"):
    sharding.q8_spec_for_layout(WeightLayout((4, 32, 64), (0, 1), (2,)), P("a", "b", None))
  with pytest.raises(ValueError, match="not a multiple of 32"):  # K=48 is padded to 64
    sharding.q8_spec_for_layout(WeightLayout((48, 64), (0,), (1,)), P("tp", None))


def test_q8_matmul_sharded_refuses_mismatched_activation_split():
  a = quantize(np.ones((64, 64), np.float32))
  x = jnp.ones((2, 64), jnp.float32)
  with pytest.raises(ValueError, match="must match"):
    sharding.q8_matmul_sharded(x, a, TP2, w_spec=P("tp", None), x_spec=P(None, None))
  with pytest.raises(ValueError, match="used twice"):
    sharding.q8_matmul_sharded(x, a, TP2, w_spec=P(None, "tp"), x_spec=P("tp", None))
  with pytest.raises(ValueError, match="K=64 .* over 4 devices"):
    sharding.q8_matmul_sharded(x, a, DP_TP, w_spec=P("tp", None))


def test_specs_match_exact_paths_before_regexes_and_report_unused_keys():
  params = {
    "up": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros((8,))},
    "down": {"kernel": jnp.zeros((8, 4))},
  }
  mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
  specs = {".*/kernel": P("tp", None), "up/kernel": P(None, "tp")}
  got = sharding.param_shardings(params, mesh, specs)
  assert got["up"]["kernel"].spec == P(None, "tp")
  assert got["down"]["kernel"].spec == P("tp", None)
  assert got["up"]["bias"].spec == P(None)
  with pytest.raises(ValueError, match=r"matched no param: \['mlp/.\*'\]"):
    sharding.param_shardings(params, mesh, {"mlp/.*": P()})
  assert sharding.param_shardings(params, mesh, {"mlp/.*": P()}, strict=False)
