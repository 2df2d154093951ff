"""assign: loaded tensors into a quantized param tree, every shape checked, nothing left over."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from qwix._src.providers.ptq import WithAux

import q8rules
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import gguf as ckpt_gguf
from q8rules.checkpoint import safetensors as ckpt_st
from q8rules.checkpoint.assign import assign, flatten
from q8rules.q8_0 import Q8Array
from tests._utils import rel_err, weights, write_gguf


def blank_q8(k: int, n: int, scale_dtype=jnp.float32, dtype=jnp.float32) -> Q8Array:
  """A Q8Array leaf as a quantized model's init leaves it (values to be overwritten)."""
  return Q8Array(
    q=jnp.ones((k, n), jnp.int8),
    scale=jnp.ones((k // 32, n), scale_dtype),
    axis=0,
    dtype=np.dtype(dtype),
  )


@pytest.fixture
def checkpoint(tmp_path, rng):
  """A GGUF file with two Q8_0 matrices and a norm, and the float weights."""
  w = {"blk.0.ffn_up.weight": weights(rng, 96, 64), "blk.0.ffn_down.weight": weights(rng, 64, 96)}
  norm = rng.standard_normal(64).astype(np.float32)
  path = tmp_path / "m.gguf"
  write_gguf(
    path, {**{k: (gguf_quantize(v, T.Q8_0), T.Q8_0) for k, v in w.items()}, "norm.weight": norm}
  )
  return path, w, norm


def template(scale_dtype=jnp.float32) -> dict:
  """A hand-built Q8 param tree as the provider makes it: WithAux(Q8Array) kernels."""
  return {
    "layers_0": {
      "mlp": {
        "up": {"kernel": WithAux(array=blank_q8(64, 96, scale_dtype), how="up-how")},
        "down": {"kernel": WithAux(array=blank_q8(96, 64, scale_dtype, jnp.bfloat16), how="d")},
      },
      "norm": {"scale": jnp.zeros(64, jnp.float32)},
    }
  }


NAME_MAP = {
  "blk.0.ffn_up.weight": ("layers_0", "mlp", "up", "kernel"),
  "blk.0.ffn_down.weight": ("layers_0", "mlp", "down", "kernel"),
  "norm.weight": "layers_0.norm.scale",  # a dotted str works too
}


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
def test_assign_into_with_aux_tree(checkpoint, scale_dtype):
  path, w, norm = checkpoint
  ckpt = ckpt_gguf.load(path)
  params = assign(template(scale_dtype), ckpt, NAME_MAP)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
    template(scale_dtype)
  )  # same WithAux.how, Q8Array axis and dtype
  up = params["layers_0"]["mlp"]["up"]["kernel"]
  down = params["layers_0"]["mlp"]["down"]["kernel"]
  assert isinstance(up, WithAux) and up.how == "up-how"
  assert down.array.dtype == np.dtype(jnp.bfloat16)
  for leaf, name in ((up.array, "blk.0.ffn_up.weight"), (down.array, "blk.0.ffn_down.weight")):
    assert isinstance(leaf.q, jax.Array) and leaf.scale.dtype == scale_dtype
    ref = q8rules.quantize(w[name].T, axis=0, scale_dtype=jnp.float16)
    np.testing.assert_array_equal(np.asarray(leaf.q), np.asarray(ref.q))
    np.testing.assert_array_equal(np.asarray(leaf.scale), np.asarray(ref.scale).astype(scale_dtype))
  np.testing.assert_array_equal(np.asarray(params["layers_0"]["norm"]["scale"]), norm)


def test_callable_name_map_and_abstract_template(checkpoint):
  path, w, _ = checkpoint
  ckpt = ckpt_gguf.load(path)
  abstract = jax.eval_shape(template)

  def name_map(name: str):
    if name == "norm.weight":
      return None  # skipped
    return ("layers_0", "mlp", "up" if "up" in name else "down", "kernel")

  with pytest.raises(CheckpointError, match=r"(?s)get no tensor.*layers_0/norm/scale"):
    assign(abstract, ckpt, name_map)
  params = assign(abstract, ckpt, name_map, strict=False)
  up = params["layers_0"]["mlp"]["up"]["kernel"].array
  assert isinstance(up.q, jax.Array)
  assert isinstance(params["layers_0"]["norm"]["scale"], jax.ShapeDtypeStruct)  # kept as given
  assert ckpt.repacked == {"blk.0.ffn_up.weight": 1, "blk.0.ffn_down.weight": 1}


def test_problems_are_named_before_anything_is_read(checkpoint):
  path, _, _ = checkpoint
  ckpt = ckpt_gguf.load(path)
  bad_map = {
    "blk.0.ffn_up.weight": ("layers_0", "mlp", "down", "kernel"),  # shape mismatch
    "blk.0.ffn_down.weight": ("layers_0", "mlp", "nope", "kernel"),  # no such leaf
  }
  with pytest.raises(CheckpointError) as e:
    assign(template(), ckpt, bad_map)
  msg = str(e.value)
  assert str(path) in msg
  assert "'blk.0.ffn_up.weight'" in msg and "layers_0/mlp/down/kernel" in msg
  assert "q shape (64, 96) != (96, 64)" in msg
  assert "'blk.0.ffn_down.weight' -> layers_0/mlp/nope/kernel: no such param leaf" in msg
  assert "layers_0/mlp/up/kernel" in msg  # missing
  assert "'norm.weight'" in msg  # left over
  assert not ckpt.repacked  # checked from the header alone


def test_missing_and_left_over(checkpoint):
  path, _, _ = checkpoint
  ckpt = ckpt_gguf.load(path)
  partial = {k: v for k, v in NAME_MAP.items() if k != "norm.weight"}
  with pytest.raises(
    CheckpointError, match=r"(?s)1 param leaf.*layers_0/norm/scale.*'norm\.weight'"
  ):
    assign(template(), ckpt, partial)
  extra = {**NAME_MAP, "not.in.file": ("layers_0", "norm", "scale")}
  with pytest.raises(CheckpointError, match=r"(?s)not among the tensors.*'not\.in\.file'"):
    assign(template(), ckpt, extra)
  params = assign(template(), ckpt, partial, strict=False)
  assert not np.asarray(params["layers_0"]["norm"]["scale"]).any()  # left as it was


def test_kind_and_dtype_mismatches(checkpoint, rng):
  path, _, _ = checkpoint
  ckpt = ckpt_gguf.load(path)
  tree = {
    "dense": {"kernel": jnp.zeros((64, 96), jnp.float32)},  # a float param
    "q": {"kernel": WithAux(array=blank_q8(64, 64), how=None)},
    "ids": jnp.zeros(64, jnp.int32),
  }
  tensors = {
    "up": ckpt["blk.0.ffn_up.weight"],
    "float_for_q8": rng.standard_normal((64, 64)).astype(np.float32),
    "ids": rng.standard_normal(64).astype(np.float32),
  }
  name_map = {"up": ("dense", "kernel"), "float_for_q8": ("q", "kernel"), "ids": ("ids",)}
  with pytest.raises(CheckpointError) as e:
    assign(tree, tensors, name_map)
  msg = str(e.value)
  assert "'up'" in msg and "the param is a float array" in msg
  assert "'float_for_q8'" in msg and "the param is Q8_0 but the tensor is not quantized" in msg
  assert "'ids'" in msg and "dtype float32 for a param of int32" in msg
  two = {"up": ("q", "kernel"), "float_for_q8": ("q", "kernel")}
  with pytest.raises(CheckpointError, match="both go to q/kernel"):
    assign(tree, tensors, two, strict=False)


def test_scale_narrowing_only_when_exact(rng):
  w = weights(rng, 64, 64)
  a32 = q8rules.quantize(w, axis=0, scale_dtype=jnp.float32)
  tree = {"k": WithAux(array=blank_q8(64, 64, jnp.float16), how=None)}
  with pytest.raises(CheckpointError, match=r"'t' -> k: .*float32 scales are not all float16"):
    assign(tree, {"t": a32}, {"t": ("k",)})
  exact = Q8Array(q=a32.q, scale=a32.scale.astype(jnp.float16).astype(jnp.float32), axis=0)
  out = assign(tree, {"t": exact}, {"t": ("k",)})["k"].array
  assert out.scale.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(out.scale), np.asarray(a32.scale.astype(jnp.float16)))


def test_float_leaves_cast_to_the_param_dtype(rng):
  x = rng.standard_normal((3, 5)).astype(np.float32)
  tree = {"w": jnp.zeros((3, 5), jnp.bfloat16), "h": np.zeros((3, 5), np.float32)}
  out = assign(tree, {"a": x, "b": x.astype(np.float16)}, {"a": ("w",), "b": ("h",)})
  assert out["w"].dtype == jnp.bfloat16 and isinstance(out["w"], jax.Array)
  np.testing.assert_array_equal(np.asarray(out["w"]), x.astype(jnp.bfloat16))
  assert isinstance(out["h"], np.ndarray) and out["h"].dtype == np.float32  # numpy stays numpy
  np.testing.assert_array_equal(out["h"], x.astype(np.float16).astype(np.float32))


def test_safetensors_tree_back_into_a_with_aux_template(tmp_path, checkpoint):
  path, _, _ = checkpoint
  params = assign(template(), ckpt_gguf.load(path), NAME_MAP)
  ckpt_st.save(tmp_path / "p.safetensors", params)
  plain = ckpt_st.load(tmp_path / "p.safetensors")
  assert isinstance(plain["layers_0"]["mlp"]["up"]["kernel"], Q8Array)  # wrapper not stored
  back = assign(template(), flatten(plain), lambda name: name)
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- end to end: a Flax model served from a GGUF file -----------------------------


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(128, name="up")(x))
    return nn.Dense(32, name="down")(x)


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
def test_linen_mlp_from_a_gguf_file(tmp_path, rng, scale_dtype):
  model = qwix.quantize_model(
    MLP(), q8rules.Q8Provider([q8rules.Q8Rule(module_path=".*", scale_dtype=scale_dtype)])
  )
  x = rng.standard_normal((8, 64)).astype(np.float32)
  variables = model.init(jax.random.key(0), jnp.asarray(x))
  # llama.cpp's side: weights [n_out, n_in], quantised by gguf.quants
  w_up, w_down = weights(rng, 128, 64), weights(rng, 32, 128)
  b_up, b_down = rng.standard_normal(128), rng.standard_normal(32)
  raw_up, raw_down = gguf_quantize(w_up, T.Q8_0), gguf_quantize(w_down, T.Q8_0)
  path = tmp_path / "mlp.gguf"
  write_gguf(
    path,
    {
      "ffn_up.weight": (raw_up, T.Q8_0),
      "ffn_up.bias": b_up.astype(np.float32),
      "ffn_down.weight": (raw_down, T.Q8_0),
      "ffn_down.bias": b_down.astype(np.float32),
    },
  )
  names = {"ffn_up": "up", "ffn_down": "down"}

  def name_map(name: str):
    layer, kind = name.split(".")
    return ("params", names[layer], "kernel" if kind == "weight" else "bias")

  params = assign(variables, ckpt_gguf.load(path), name_map)
  y = np.asarray(model.apply(params, jnp.asarray(x)))

  # float64 reference from llama.cpp's own dequantisation
  up = gguf_dequantize(raw_up, T.Q8_0).astype(np.float64).T
  down = gguf_dequantize(raw_down, T.Q8_0).astype(np.float64).T
  h = np.maximum(x.astype(np.float64) @ up + b_up.astype(np.float32), 0)
  ref = h @ down + b_down.astype(np.float32)
  assert rel_err(y, ref) <= 1e-6  # about 2e-7 on CPU
