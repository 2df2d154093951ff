"""Sharding annotations carried from a float param to its 2-D Q8_0 values.

An N-D weight's annotation (nnx `Param(..., sharding=...)`, linen `nn.with_partitioning`)
becomes the (K, N) spec of `q` and `scale`: the mesh axes of the contracted axes split K, the
others split N; a free axis the annotation splits goes first in N (Gemma's kv einsum
(2, heads, D, H) split on heads). Under a mesh in context, or with the float param placed on
one, a K split that would cut a 32-row block is refused, naming the param. The sharded run itself is in test_tunix_sharded.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import q8rules
from q8rules.layout import WeightLayout
from q8rules.tree_paths import path_str
from tests._utils import rel_err
from tests.ecosystem.reference import dense_layout, round_trip64

D, HEADS, H = 64, 4, 32


class Attn(nnx.Module):
  """Gemma's kv einsum and output projection, with Gemma's annotations."""

  def __init__(self, rng: np.random.Generator):
    def w(shape: tuple[int, ...], sharding: tuple) -> nnx.Param:
      v = rng.standard_normal(shape) / np.sqrt(D)
      return nnx.Param(jnp.asarray(v.astype(np.float32)), sharding=sharding, eager_sharding=False)

    self.kv = w((2, HEADS, D, H), (None, "tp", "fsdp", None))
    self.o = w((HEADS, H, D), ("tp", None, "fsdp"))

  def __call__(self, x: jax.Array) -> jax.Array:
    k, v = jnp.einsum("BSD,CKDH->CBSKH", x, self.kv[...])
    return jnp.einsum("BSKH,KHD->BSD", k * v, self.o[...])


def reference64(model: Attn, x: np.ndarray) -> np.ndarray:
  kv = round_trip64(model.kv[...], WeightLayout((2, HEADS, D, H), (2,), (0, 1, 3)))
  o = round_trip64(model.o[...], dense_layout((HEADS, H, D), k_axes=2))
  k, v = np.einsum("bsd,ckdh->cbskh", np.asarray(x, np.float64), kv)
  return np.einsum("bskh,khd->bsd", k * v, o)


def _annotations(model: nnx.Module) -> dict[str, tuple]:
  state = nnx.state(model, nnx.Param)
  specs = nnx.get_partition_spec(state)
  return {
    path_str(path): tuple(spec)
    for path, spec in jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(specs), is_leaf=lambda s: isinstance(s, P)
    )[0]
  }


def test_nnx_annotations_become_2d_specs(rng):
  x = jnp.asarray(rng.standard_normal((2, 3, D)).astype(np.float32))
  model = Attn(rng)
  q8 = qwix.quantize_model(model, q8rules.Q8Provider([q8rules.Q8Rule()]), x)
  assert _annotations(q8) == {
    "kv/array/q": ("fsdp", "tp"),
    "kv/array/scale": ("fsdp", "tp"),
    "o/array/q": ("tp", "fsdp"),
    "o/array/scale": ("tp", "fsdp"),
  }
  assert q8.kv.how.layout.free == (1, 0, 3)  # heads first in N: a contiguous split
  assert rel_err(q8(x), reference64(model, np.asarray(x))) <= 1e-5
  assert rel_err(nnx.jit(lambda m, a: m(a))(q8, x), q8(x)) <= 1e-6


def _mesh(fsdp: int, tp: int) -> AbstractMesh:
  return AbstractMesh((fsdp, tp), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


@pytest.mark.slow
def test_a_k_split_cutting_a_block_is_refused_naming_the_param(rng):
  x = jnp.asarray(rng.standard_normal((2, 3, D)).astype(np.float32))
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  with jax.sharding.use_abstract_mesh(_mesh(2, 2)):  # K = 64: 32 rows a device
    qwix.quantize_model(Attn(rng), provider, x)
  with (
    jax.sharding.use_abstract_mesh(_mesh(4, 1)),  # 16 rows a device cut every block
    pytest.raises(ValueError, match=r"^kv: cannot split K=64 rows .* over 4 devices"),
  ):
    qwix.quantize_model(Attn(rng), provider, x)


def _placed(model: nnx.Module, fsdp: int, tp: int) -> nnx.Module:
  """`model` placed on a real (fsdp, tp) mesh by its annotations, no mesh in context."""
  if jax.device_count() < fsdp * tp:
    pytest.skip(f"needs {fsdp * tp} devices (tests/conftest.py sets 8 on CPU)")
  auto = (AxisType.Auto, AxisType.Auto)
  mesh = jax.make_mesh(
    (fsdp, tp), ("fsdp", "tp"), axis_types=auto, devices=jax.devices()[: fsdp * tp]
  )
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
  return model


@pytest.mark.slow
def test_a_k_split_cutting_a_block_of_a_placed_param_is_refused_naming_it(rng):
  """No mesh in context, the float params placed on one (Tunix's models as restored onto a
  mesh): the placed param's mesh is checked."""
  x = jnp.asarray(rng.standard_normal((2, 3, D)).astype(np.float32))
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8 = qwix.quantize_model(_placed(Attn(rng), 2, 2), provider, x)
  assert q8.kv.array.q[...].sharding.spec == P("fsdp", "tp")
  with pytest.raises(ValueError, match=r"^kv: cannot split K=64 rows .* over 4 devices"):
    qwix.quantize_model(_placed(Attn(rng), 4, 1), provider, x)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.lecun_normal()
    h = nn.DenseGeneral(
      (HEADS, H), kernel_init=nn.with_partitioning(init, ("fsdp", "tp", None)), name="up"
    )(x)
    return nn.DenseGeneral(
      D, axis=(-2, -1), kernel_init=nn.with_partitioning(init, ("tp", None, "fsdp")), name="down"
    )(jax.nn.gelu(h))


def test_linen_partitioning_becomes_2d_names(rng):
  x = jnp.asarray(rng.standard_normal((2, D)).astype(np.float32))
  q8_model = qwix.quantize_model(Mlp(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  variables = q8_model.init(jax.random.key(0), x)
  names = {
    "/".join(str(k.key) for k in path if hasattr(k, "key")): box.names
    for path, box in jax.tree_util.tree_flatten_with_path(
      variables["params"], is_leaf=lambda b: isinstance(b, nn.Partitioned)
    )[0]
    if isinstance(box, nn.Partitioned)
  }
  assert names["up/kernel"] == ("fsdp", "tp") and names["down/kernel"] == ("tp", "fsdp")
  float_params = nn.unbox(Mlp().init(jax.random.key(0), x)["params"])
  served = q8_model.apply(
    {"params": q8rules.quantize_params(float_params, nn.unbox(variables)["params"])}, x
  )
  up = round_trip64(float_params["up"]["kernel"], dense_layout((D, HEADS, H)))
  down = round_trip64(float_params["down"]["kernel"], dense_layout((HEADS, H, D), k_axes=2))
  h = np.einsum("bd,dkh->bkh", np.asarray(x, np.float64), up) + np.asarray(
    float_params["up"]["bias"]
  )
  gelu = np.asarray(jax.nn.gelu(jnp.asarray(h, jnp.float32)), np.float64)
  ref = np.einsum("bkh,khd->bd", gelu, down) + np.asarray(float_params["down"]["bias"])
  assert rel_err(served, ref) <= 1e-5
