"""`GGUFModel.save_gguf` and `load_gguf(trainable='qat')` on the committed tiny GGUF files.

References are gguf-py's (llama.cpp's Python package): `GGUFReader` for what a file holds,
`gguf.quants` for Q8_0 blocks (llama.cpp's quantizer) and their values; llama.cpp itself
(tests/_llamacpp.py) loads the files written. Real files: tests/test_save_gguf_real.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import q8rules
from q8rules.checkpoint import CheckpointError
from q8rules.llm import load_gguf
from q8rules.models.attention import init_cache
from tests._llamacpp import llama_logits
from tests._utils import copy_gguf

DATA = Path(__file__).parent / "data" / "gguf_models"


def read(path: Path) -> tuple[list, dict]:
  """(tensors as (name, type, shape, bytes) in order, metadata key -> (types, value))."""
  r = gguf.GGUFReader(path)
  tensors = [(t.name, t.tensor_type, tuple(t.shape), t.data.tobytes()) for t in r.tensors]
  fields = {k: (f.types, f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
  return tensors, fields


def flat(params) -> dict[str, np.ndarray]:
  """Every array of a param tree by its path (a Q8 param's q and scale apart)."""
  out = {}
  for p, x in jax.tree_util.tree_leaves_with_path(params):
    out[jax.tree_util.keystr(p)] = np.asarray(x)
  return out


def assert_same_params(a, b) -> None:
  fa, fb = flat(a), flat(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
    assert fa[k].tobytes() == fb[k].tobytes(), k


def tensor(path: Path, name: str) -> gguf.ReaderTensor:
  return next(t for t in gguf.GGUFReader(path).tensors if t.name == name)


def with_params(m, **changes):
  """`m` with params changed at '/'-joined paths: value or f(old)."""
  params = jax.tree.map(lambda x: x, m.params, is_leaf=lambda x: not isinstance(x, dict))
  for key, change in changes.items():
    *parents, leaf = key.split("/")
    node = params
    for k in parents:
      node = node[k]
    node[leaf] = change(node[leaf]) if callable(change) else change
  return dataclasses.replace(m, params=params)


def quantize_ref(w_gguf: np.ndarray) -> bytes:
  """gguf.quants' Q8_0 blocks of a float matrix in GGUF order."""
  return gguf.quants.quantize(np.asarray(w_gguf, np.float32), T.Q8_0).tobytes()


# ---- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "name, how",
  [
    ("tiny-llama-q8_0", "fused"),
    ("tiny-llama-q8_0", "unfused"),
    ("tiny-llama-q8_0", "unrolled"),
    ("tiny-qwen2-q8_0", "fused"),  # tied embeddings, q|k|v biases
    ("tiny-phi3-q8_0", "fused"),  # attn_qkv and gate|up ffn_up in the file
    ("tiny-gemma3-f32", "fused"),  # float matrices, per-head q/k norms
  ],
)
def test_round_trip_is_the_identity(tmp_path, name, how):
  src = DATA / f"{name}.gguf"
  m = load_gguf(src, dtype=jnp.float32, fuse=how != "unfused")
  if how == "unrolled":
    m = m.unrolled()
  out = tmp_path / "out.gguf"
  m.save_gguf(out)
  assert read(out) == read(src)
  assert os.listdir(tmp_path) == ["out.gguf"]
  assert_same_params(
    load_gguf(out, dtype=jnp.float32, fuse=how != "unfused").params,
    (load_gguf(src, dtype=jnp.float32, fuse=how != "unfused").params),
  )


def quantized_copy(src: Path, dst: Path, kinds: dict[str, T]) -> None:
  """`src` with each matrix whose name contains a key of `kinds` quantized to that type."""

  def convert(t):
    for key, qtype in kinds.items():
      if key in t.name and len(t.shape) == 2:
        return gguf.quants.quantize(np.asarray(t.data, np.float32), qtype), qtype
    return np.asarray(t.data), t.tensor_type

  copy_gguf(src, dst, convert)


def test_requantized_types_stay_theirs_and_a_changed_matrix_is_q8_0(tmp_path, rng):
  """A Q4_0 / Q5_1 file (requantized to Q8_0 at load): saved unchanged, every tensor keeps its
  type and bytes; a changed member of a fused matrix is written as Q8_0, the rest as it was."""
  src = tmp_path / "mixed.gguf"
  quantized_copy(DATA / "tiny-llama-f32.gguf", src, {"attn": T.Q4_0, "ffn": T.Q5_1})
  m = load_gguf(src, dtype=jnp.float32)
  assert m.requantized and m.config.fused_qkv
  m.save_gguf(tmp_path / "same.gguf")
  assert read(tmp_path / "same.gguf") == read(src)

  qkv = m.params["layers"]["attn"]["qkv"]["kernel"]
  c = m.config
  k_cols = slice(c.heads * c.head_dim, (c.heads + c.kv_heads) * c.head_dim)
  q = np.asarray(qkv.array.q).copy()
  q[1, :, k_cols] = rng.integers(-127, 128, q[1, :, k_cols].shape)
  changed = with_params(
    m,
    **{
      "layers/attn/qkv/kernel": qkv.replace(array=dataclasses.replace(qkv.array, q=jnp.asarray(q)))
    },
  )
  out = tmp_path / "out.gguf"
  changed.save_gguf(out)
  got, want = read(out)[0], read(src)[0]
  assert [t[0] for t in got] == [t[0] for t in want]
  for g, w in zip(got, want, strict=True):
    if g[0] == "blk.1.attn_k.weight":
      assert g[1] == T.Q8_0 and w[1] == T.Q4_0
      t = tensor(out, g[0])
      d = np.asarray(qkv.array.scale[1, :, k_cols], np.float64)  # (K / 32, N): unchanged
      ref = (q[1, :, k_cols].astype(np.float64) * np.repeat(d, 32, axis=0)).T
      np.testing.assert_array_equal(gguf.quants.dequantize(t.data, T.Q8_0), ref)
    else:
      assert g == w, g[0]
  assert_same_params(load_gguf(out, dtype=jnp.float32).params, changed.params)


def test_hand_changed_q8_0_param_and_norm(tmp_path, rng):
  """A Q8_0 file: layer 1's attn_k (columns of the fused q|k|v) given new Q8_0 blocks and layer
  0's attn_norm scaled: those two tensors are written (Q8_0 blocks as they are; F32), every
  other tensor is the source's bytes, and `load_gguf` reads the params back bit for bit."""
  src = DATA / "tiny-llama-q8_0.gguf"
  m = load_gguf(src, dtype=jnp.float32)
  changed, q, d = changed_llama(m, rng)
  out = tmp_path / "out.gguf"
  changed.save_gguf(out)
  got, fields = read(out)
  assert fields == read(src)[1]
  for g, w in zip(got, read(src)[0], strict=True):
    if g[0] == "blk.1.attn_k.weight":
      assert g[1] == T.Q8_0
      ref = (q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=0)).T
      np.testing.assert_array_equal(gguf.quants.dequantize(tensor(out, g[0]).data, T.Q8_0), ref)
    elif g[0] == "blk.0.attn_norm.weight":
      assert g[1] == T.F32
      ref = np.asarray(changed.params["layers"]["attn_norm"]["scale"][0])
      np.testing.assert_array_equal(np.asarray(tensor(out, g[0]).data), ref)
      assert g[3] != w[3]
    else:
      assert g == w, g[0]
  assert_same_params(load_gguf(out, dtype=jnp.float32).params, changed.params)


def changed_llama(m, rng):
  """`m` (tiny llama, fused) with layer 1's attn_k new Q8_0 blocks (random q, float16 scales
  near the file's) and layer 0's attn_norm times 1.25; and the new (q, scale) of attn_k."""
  qkv = m.params["layers"]["attn"]["qkv"]["kernel"]
  c = m.config
  cols = slice(c.heads * c.head_dim, (c.heads + c.kv_heads) * c.head_dim)
  k, n = qkv.array.q.shape[1], cols.stop - cols.start
  new_q = rng.integers(-127, 128, (k, n)).astype(np.int8)
  new_d = np.asarray(qkv.array.scale[1, :, cols], np.float32) * rng.uniform(0.5, 1.5, (k // 32, n))
  new_d = new_d.astype(np.float16)
  array = dataclasses.replace(
    qkv.array,
    q=qkv.array.q.at[1, :, cols].set(new_q),
    scale=qkv.array.scale.at[1, :, cols].set(new_d),
  )
  changed = with_params(
    m,
    **{
      "layers/attn/qkv/kernel": qkv.replace(array=array),
      "layers/attn_norm/scale": lambda s: s.at[0].multiply(1.25),
    },
  )
  return changed, new_q, new_d


def test_float_matrices_are_quantized_as_llama_cpp_does(tmp_path, rng):
  """A float param in place of a Q8_0 one (a QAT model's): a layer whose values are the file's
  q * d is the file's blocks; a changed layer is gguf.quants' Q8_0 blocks of it, bit for bit."""
  src = DATA / "tiny-llama-q8_0.gguf"
  m = load_gguf(src, dtype=jnp.float32)
  down = m.params["layers"]["mlp"]["down"]["kernel"].array
  w = np.asarray(down.q, np.float32) * np.repeat(np.asarray(down.scale, np.float32), 32, axis=1)
  w[1] += rng.normal(0, 0.05, w[1].shape).astype(np.float32)
  changed = with_params(m, **{"layers/mlp/down/kernel": jnp.asarray(w)})
  out = tmp_path / "out.gguf"
  changed.save_gguf(out)
  assert tensor(out, "blk.0.ffn_down.weight").data.tobytes() == (
    tensor(src, "blk.0.ffn_down.weight").data.tobytes()
  )
  t = tensor(out, "blk.1.ffn_down.weight")
  assert t.tensor_type == T.Q8_0 and t.data.tobytes() == quantize_ref(w[1].T)


def test_a_split_source_is_written_as_one_file(tmp_path):
  src = DATA / "tiny-qwen2-q8_0.gguf"
  copy_gguf(src, tmp_path / "split.gguf", split_max_tensors=8)
  parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
  assert len(parts) > 1
  out = tmp_path / "out.gguf"
  load_gguf(parts[0], dtype=jnp.float32).save_gguf(out)
  tensors, fields = read(out)
  src_tensors, src_fields = read(src)
  assert tensors == src_tensors and fields == src_fields


# ---- errors: clear, and nothing written -------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
  return load_gguf(DATA / "tiny-llama-q8_0.gguf", dtype=jnp.float32)


def norm_with(value):
  return {"layers/mlp_norm/scale": value}


@pytest.mark.parametrize(
  "change, message",
  [
    (norm_with(jnp.ones((2, 129), jnp.float32)), r"'blk.0.ffn_norm.weight'.*shape \(2, 129\)"),
    (norm_with(jnp.ones((2, 128), jnp.int32)), r"'blk.0.ffn_norm.weight'.*dtype int32"),
    (
      norm_with(lambda s: s.at[1, 5].set(jnp.nan)),
      r"'blk.1.ffn_norm.weight' \(param layers/mlp_norm/scale\[1\]\): 1 non-finite",
    ),
    (
      {
        "layers/mlp/down/kernel": lambda w: w.replace(
          array=dataclasses.replace(w.array, scale=w.array.scale.at[1, 0, 3].set(jnp.inf))
        )
      },
      r"'blk.1.ffn_down.weight'.*non-finite Q8_0 scale",
    ),
    ({"layers/attn_norm/scale": None}, r"'blk.0.attn_norm.weight'.*param has NoneType"),
  ],
)
def test_bad_params_name_the_tensor_and_write_nothing(tmp_path, tiny, change, message):
  with pytest.raises(CheckpointError, match=message):
    with_params(tiny, **change).save_gguf(tmp_path / "out.gguf")
  assert os.listdir(tmp_path) == []


def test_unwritable_path(tmp_path, tiny):
  (tmp_path / "file").write_text("")
  for target in (tmp_path / "missing" / "out.gguf", tmp_path / "file" / "out.gguf"):
    with pytest.raises(CheckpointError, match=f"{target}: cannot write there"):
      tiny.save_gguf(target)
  assert os.listdir(tmp_path) == ["file"]


def test_source_overwritten_or_changed(tmp_path):
  src = tmp_path / "src.gguf"
  shutil.copy(DATA / "tiny-llama-q8_0.gguf", src)
  m = load_gguf(src, dtype=jnp.float32)
  with pytest.raises(CheckpointError, match="the model's own source file"):
    m.save_gguf(src)
  os.utime(src, ns=(0, 0))
  with pytest.raises(CheckpointError, match=f"{src}: the model's source file has changed"):
    m.save_gguf(tmp_path / "out.gguf")
  assert sorted(os.listdir(tmp_path)) == ["src.gguf"]


def test_a_model_not_from_load_gguf(tmp_path, tiny):
  no_source = dataclasses.replace(tiny, source=None)
  with pytest.raises(ValueError, match="not loaded by load_gguf"):
    no_source.save_gguf(tmp_path / "out.gguf")
  assert os.listdir(tmp_path) == []


# ---- QAT from a GGUF --------------------------------------------------------------------


def next_token_loss(model, params, ids):
  """Mean next-token cross-entropy of ids (1, T) under `model` (a GGUFModel's module)."""
  logits, _ = model.model.apply({"params": params}, ids[:, :-1], init_cache(model.config, 64), 0)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()


@pytest.mark.parametrize(
  "name", ["tiny-llama-q8_0", pytest.param("tiny-phi3-q8_0", marks=pytest.mark.slow)]
)
@pytest.mark.slow
def test_qat_model_is_the_served_model_in_float(tmp_path, name):
  """Each matrix the served model holds as Q8_0 is a float32 param equal to gguf.quants'
  dequantization of the file's tensor; the logits are the served model's (to float32
  rounding; measured: equal); saved untrained, the file is the source's."""
  src = DATA / f"{name}.gguf"
  served = load_gguf(src, dtype=jnp.float32)
  qat = load_gguf(src, dtype=jnp.float32, trainable="qat")
  kernels = qat.params["layers"]["attn"]
  key = "qkv" if "qkv" in kernels else "q"
  w = np.asarray(kernels[key]["kernel"])
  assert w.dtype == np.float32
  ref = gguf.quants.dequantize(tensor(src, "blk.1.attn_output.weight").data, T.Q8_0).T
  np.testing.assert_array_equal(np.asarray(qat.params["layers"]["attn"]["o"]["kernel"][1]), ref)
  ids = (np.arange(40) * 7 + 3) % served.config.vocab
  a, b = served.logits(ids), qat.logits(ids)
  assert np.linalg.norm(a - b) / np.linalg.norm(a) <= 1e-6
  qat.save_gguf(tmp_path / "out.gguf")
  assert read(tmp_path / "out.gguf") == read(src)


@pytest.mark.slow
def test_qat_training_step_is_saved_as_q8_0(tmp_path):
  """An SGD step of jax.grad on the QAT model lowers the loss and changes its weights;
  save_gguf writes each trained matrix as gguf.quants' Q8_0 blocks of it (bit for bit) and
  each norm as F32; the file loads back (served, and for QAT: the trained weights' Q8_0
  values) and the served model's loss on it is the trained QAT model's (to float32
  rounding)."""
  src = DATA / "tiny-llama-q8_0.gguf"
  qat = load_gguf(src, dtype=jnp.float32, trainable="qat")
  ids = jnp.asarray((np.arange(33) * 5 + 1) % qat.config.vocab, jnp.int32)[None]
  loss = jax.jit(jax.value_and_grad(lambda p: next_token_loss(qat, p, ids)))
  before, grads = loss(qat.params)
  params = jax.tree.map(lambda p, g: p - 0.05 * g, qat.params, grads)
  after, _ = loss(params)
  assert after < before
  trained = dataclasses.replace(qat, params=params)
  out = tmp_path / "out.gguf"
  trained.save_gguf(out)
  o = np.asarray(params["layers"]["attn"]["o"]["kernel"])
  assert not np.array_equal(o, np.asarray(qat.params["layers"]["attn"]["o"]["kernel"]))
  for i in range(qat.config.layers):
    t = tensor(out, f"blk.{i}.attn_output.weight")
    assert t.tensor_type == T.Q8_0 and t.data.tobytes() == quantize_ref(o[i].T)
    norm = tensor(out, f"blk.{i}.attn_norm.weight")
    assert norm.tensor_type == T.F32
    np.testing.assert_array_equal(norm.data, np.asarray(params["layers"]["attn_norm"]["scale"][i]))
  back = load_gguf(out, dtype=jnp.float32)
  served_loss = jax.jit(lambda p: next_token_loss(back, p, ids))(back.params)
  assert abs(float(served_loss) / float(after) - 1) <= 1e-6, (float(served_loss), float(after))
  back_qat = flat(load_gguf(out, dtype=jnp.float32, trainable="qat").params)
  fake_quant = jax.jit(lambda v: q8rules.dequantize(q8rules.quantize(v, -2, jnp.float16)))
  for k, v in flat(params).items():
    if "kernel" in k or "table" in k:  # the matrices: the Q8_0 values of the trained weights
      np.testing.assert_array_equal(back_qat[k], np.asarray(fake_quant(v)), err_msg=k)
    else:
      np.testing.assert_array_equal(back_qat[k], v, err_msg=k)


def test_trainable_must_be_known():
  with pytest.raises(ValueError, match="trainable must be one of"):
    load_gguf(DATA / "tiny-llama-q8_0.gguf", trainable="lora")


# ---- llama.cpp loads what is written ----------------------------------------------------


def rel_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_llama_cpp_runs_a_changed_file(tmp_path, rng):
  """llama.cpp loads the file with changed tensors, and its logits on it are as close to ours
  as on the source file (within 1.5 times, the issue's bound)."""
  src = DATA / "tiny-llama-q8_0.gguf"
  m = load_gguf(src, dtype=jnp.float32)
  changed, _, _ = changed_llama(m, rng)
  out = tmp_path / "out.gguf"
  changed.save_gguf(out)
  ids = ((np.arange(48) * 11 + 2) % m.config.vocab).tolist()
  base = rel_l2(m.logits(ids), llama_logits(src, ids))
  theirs = llama_logits(out, ids)
  ours = changed.logits(ids)
  assert rel_l2(ours, m.logits(ids)) > 10 * base  # the change shows in the logits
  assert rel_l2(ours, theirs) <= 1.5 * base, (rel_l2(ours, theirs), base)


def test_on_a_mesh(tmp_path):
  """Params split over a 'tp' mesh (served and QAT) are written back as the source."""
  from jax.sharding import Mesh

  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  src = DATA / "tiny-llama-q8_0.gguf"
  for trainable in (None, "qat"):
    m = load_gguf(src, dtype=jnp.float32, mesh=mesh, trainable=trainable)
    m.save_gguf(tmp_path / "out.gguf")
    assert read(tmp_path / "out.gguf") == read(src), trainable
