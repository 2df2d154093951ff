"""safetensors: Q8 param trees saved and loaded bit for bit."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix
import safetensors
import safetensors.numpy
from qwix._src.providers.ptq import WithAux

import q8rules
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import safetensors as ckpt_st
from q8rules.q8_0 import Q8Array


def bits(x) -> np.ndarray:
  """The raw bits of an array, for bitwise comparison (nan-safe)."""
  x = np.ascontiguousarray(np.asarray(x))
  return x.view(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x


def assert_same_tree(a, b) -> None:
  leaves_a, tree_a = jax.tree_util.tree_flatten(a, is_leaf=lambda x: isinstance(x, Q8Array))
  leaves_b, tree_b = jax.tree_util.tree_flatten(b, is_leaf=lambda x: isinstance(x, Q8Array))
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b, strict=True):
    if isinstance(x, Q8Array):
      assert isinstance(y, Q8Array)
      assert (x.axis, np.dtype(x.dtype)) == (y.axis, np.dtype(y.dtype))
      x, y = (x.q, x.scale), (y.q, y.scale)
    else:
      x, y = (x,), (y,)
    for u, v in zip(x, y, strict=True):
      assert np.asarray(u).dtype == np.asarray(v).dtype
      assert np.shape(u) == np.shape(v)
      np.testing.assert_array_equal(bits(u), bits(v))


@pytest.fixture
def params(rng):
  """A Q8 param tree: Q8Arrays (float32 and float16 scales, axis 0 and 1, a bf16
  dtype), float32 / bfloat16 / float16 / int32 arrays, a scalar, jax and numpy."""

  def w(*shape):
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 2, shape[-1])).astype(np.float32)

  return {
    "layers_0": {
      "mlp": {
        "kernel": q8rules.quantize(w(64, 48), axis=0),
        "bias": jnp.asarray(w(48)),
      },
      "attn": {
        "kernel": q8rules.quantize(w(96, 32), axis=0, scale_dtype=jnp.float16),
        "out": q8rules.quantize(w(16, 64).astype(jnp.bfloat16), axis=1),
      },
      "norm": {"scale": w(64).astype(ml_dtypes.bfloat16)},
    },
    "embed": {"embedding": w(10, 8).astype(np.float16)},
    "step": np.asarray(rng.integers(1, 1000), np.int32),
    "ids": rng.integers(-(2**31), 2**31 - 1, (5,), dtype=np.int32),
  }


def test_round_trip_is_bitwise(tmp_path, params):
  path = tmp_path / "p.safetensors"
  ckpt_st.save(path, params, metadata={"model": "tiny", "step": "7"})
  back = ckpt_st.load(path)
  assert_same_tree(back, params)
  out = back["layers_0"]["attn"]["out"]
  assert out.axis == 1 and out.dtype == jnp.bfloat16 and out.scale.dtype == np.float32
  assert isinstance(out.q, np.ndarray)  # host arrays
  assert ckpt_st.read_metadata(path) == {"model": "tiny", "step": "7"}


def test_naming_convention(tmp_path, params):
  path = tmp_path / "p.safetensors"
  ckpt_st.save(path, params)
  with safetensors.safe_open(str(path), framework="np") as f:
    names = set(f.keys())
    meta = f.metadata()
    assert f.get_slice("layers_0.norm.scale").get_dtype() == "BF16"
  assert names == {
    "layers_0.mlp.kernel.q8",
    "layers_0.mlp.kernel.q8_scale",
    "layers_0.mlp.bias",
    "layers_0.attn.kernel.q8",
    "layers_0.attn.kernel.q8_scale",
    "layers_0.attn.out.q8",
    "layers_0.attn.out.q8_scale",
    "layers_0.norm.scale",
    "embed.embedding",
    "step",
    "ids",
  }
  info = json.loads(meta[ckpt_st.META_KEY])
  assert info["version"] == 1
  assert info["q8"]["layers_0.mlp.kernel"] == {"axis": 0, "dtype": "float32"}
  assert info["q8"]["layers_0.attn.out"] == {"axis": 1, "dtype": "bfloat16"}


def test_wrappers_are_written_without_them(tmp_path, params):
  wrapped = {"layers_0": {"kernel": WithAux(array=params["layers_0"]["mlp"]["kernel"], how=None)}}
  ckpt_st.save(tmp_path / "w.safetensors", wrapped)
  back = ckpt_st.load(tmp_path / "w.safetensors")
  assert_same_tree(back, {"layers_0": {"kernel": params["layers_0"]["mlp"]["kernel"]}})


@pytest.mark.parametrize(
  "tree, match",
  [
    ({"a": [np.ones(2, np.float32)]}, "not a str dict key"),
    ({"a": {1: np.ones(2, np.float32)}}, "not a str dict key"),
    ({"a.b": np.ones(2, np.float32)}, "holds '.'"),
    ({"a": {"": np.ones(2, np.float32)}}, "is empty"),
    (np.ones(3, np.float32), "single leaf"),
  ],
)
def test_trees_that_cannot_be_saved(tmp_path, tree, match):
  path = tmp_path / "t.safetensors"
  with pytest.raises(CheckpointError, match=match) as e:
    ckpt_st.save(path, tree)
  assert str(path) in str(e.value)
  assert not list(tmp_path.iterdir())  # nothing half written


def test_names_that_look_like_q8_parts_stay_arrays(tmp_path, rng):
  """Only the header makes a Q8Array: a plain `k.q8` tensor is an array at k/q8."""
  q8 = q8rules.quantize(rng.standard_normal((32, 2)).astype(np.float32))
  tree = {"k": {"q8": rng.standard_normal(2).astype(np.float32)}, "x": q8}
  ckpt_st.save(tmp_path / "ok.safetensors", tree)
  assert_same_tree(ckpt_st.load(tmp_path / "ok.safetensors"), tree)
  other = tmp_path / "other.safetensors"  # a safetensors file from elsewhere
  safetensors.numpy.save_file({"model.w": np.arange(3.0), "model.b.q8": np.ones(2)}, str(other))
  loaded = ckpt_st.load(other)
  np.testing.assert_array_equal(loaded["model"]["w"], np.arange(3.0))
  np.testing.assert_array_equal(loaded["model"]["b"]["q8"], np.ones(2))


def test_reserved_metadata(tmp_path, params):
  with pytest.raises(CheckpointError, match="reserved"):
    ckpt_st.save(tmp_path / "p.safetensors", params, metadata={ckpt_st.META_KEY: "x"})
  with pytest.raises(CheckpointError, match="str -> str"):
    ckpt_st.save(tmp_path / "p.safetensors", params, metadata={"n": 3})


def test_truncated_and_garbage_files(tmp_path, params):
  path = tmp_path / "p.safetensors"
  ckpt_st.save(path, params)
  data = path.read_bytes()
  cut = tmp_path / "cut.safetensors"
  cut.write_bytes(data[:-50])
  with pytest.raises(CheckpointError, match=r"cut\.safetensors: not a readable safetensors"):
    ckpt_st.load(cut)
  junk = tmp_path / "junk.safetensors"
  junk.write_bytes(b"\xff" * 64)
  with pytest.raises(CheckpointError, match=r"junk\.safetensors: not a readable safetensors"):
    ckpt_st.load(junk)
  with pytest.raises(FileNotFoundError):
    ckpt_st.load(tmp_path / "nope.safetensors")


def test_inconsistent_q8_entries(tmp_path, rng):
  q = rng.integers(-127, 128, (64, 8), dtype=np.int8)
  scale = rng.standard_normal((2, 8)).astype(np.float32)
  meta = {
    ckpt_st.META_KEY: json.dumps({"version": 1, "q8": {"w": {"axis": 0, "dtype": "float32"}}})
  }

  def write(name, tensors):
    path = tmp_path / name
    safetensors.numpy.save_file(tensors, str(path), metadata=meta)
    return path

  ok = write("ok.safetensors", {"w.q8": q, "w.q8_scale": scale})
  np.testing.assert_array_equal(ckpt_st.load(ok)["w"].q, q)
  no_scale = write("no_scale.safetensors", {"w.q8": q})
  with pytest.raises(
    CheckpointError, match=r"no_scale\.safetensors: Q8 param 'w' has no tensor 'w\.q8_scale'"
  ):
    ckpt_st.load(no_scale)
  bad_shape = write("bad_shape.safetensors", {"w.q8": q, "w.q8_scale": scale[:1]})
  with pytest.raises(CheckpointError, match=r"bad_shape\.safetensors: Q8 param 'w'.*do not fit"):
    ckpt_st.load(bad_shape)
  bad_dtype = write("bad_dtype.safetensors", {"w.q8": q.astype(np.int16), "w.q8_scale": scale})
  with pytest.raises(CheckpointError, match="q dtype int16, not int8"):
    ckpt_st.load(bad_dtype)


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, name="up")(x)
    h = nn.Einsum((4, 16, 32), "btnh,nhd->btd", name="o")(h.reshape(*h.shape[:2], 4, 16))
    return nn.Dense(8, use_bias=False, name="down")(h)


@pytest.mark.slow
def test_load_like_gives_params_apply_takes(tmp_path, rng):
  """The README's round trip: `load(path, like=abstract)` gives WithAux(Q8Array, Q8How)
  where the abstract has them, bit for bit the saved values; plain `load` gives bare Q8Arrays,
  which `apply` rejects."""
  x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32)
  q8_model = qwix.quantize_model(_Net(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  params = q8_model.init(jax.random.key(0), x)["params"]
  abstract = jax.eval_shape(q8_model.init, jax.random.key(1), x)["params"]
  path = tmp_path / "q8.safetensors"
  ckpt_st.save(path, params)

  back = ckpt_st.load(path, like=abstract)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for name in ("up", "o", "down"):
    got, want = back[name]["kernel"], params[name]["kernel"]
    assert isinstance(got, WithAux) and got.how == want.how
    np.testing.assert_array_equal(got.array.q, want.array.q)
    np.testing.assert_array_equal(bits(got.array.scale), bits(want.array.scale))
  np.testing.assert_array_equal(
    q8_model.apply({"params": back}, x), q8_model.apply({"params": params}, x)
  )
  with pytest.raises(Exception):  # noqa: B017 (whatever Flax/Qwix raise on bare Q8Arrays)
    q8_model.apply({"params": ckpt_st.load(path)}, x)


@pytest.mark.slow
def test_load_like_names_what_does_not_fit(tmp_path, rng):
  x = jnp.ones((2, 3, 32), jnp.float32)
  q8_model = qwix.quantize_model(_Net(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  params = q8_model.init(jax.random.key(0), x)["params"]
  path = tmp_path / "q8.safetensors"
  ckpt_st.save(path, {k: v for k, v in params.items() if k != "down"})
  with pytest.raises(
    CheckpointError, match=r"(?s)q8\.safetensors: .*get no tensor:\n  down/kernel"
  ):
    ckpt_st.load(path, like=params)
