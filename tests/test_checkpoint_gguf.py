"""GGUF checkpoints: llama.cpp's Q8_0 blocks into Q8Arrays and back, bit for bit."""

from __future__ import annotations

import os
import resource

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

import q8rules
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import gguf as ckpt_gguf
from q8rules.q8_0 import BLOCK, Q8Array
from tests._utils import weights, write_gguf


def q8_bytes(w: np.ndarray) -> np.ndarray:
  """gguf's Q8_0 of `w` (numpy order, blocked along the last axis): uint8 blocks."""
  return gguf_quantize(w, T.Q8_0)


def reference(w_gguf: np.ndarray) -> Q8Array:
  """q8rules' Q8_0 of the same weight in our layout: (K=n_in, N=n_out), float16 scales."""
  return q8rules.quantize(w_gguf.T, axis=0, scale_dtype=jnp.float16)


def assert_q8_equal(a: Q8Array, b: Q8Array) -> None:
  assert a.axis == b.axis
  assert np.asarray(a.q).dtype == np.int8
  np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
  assert np.asarray(a.scale).dtype == np.asarray(b.scale).dtype
  np.testing.assert_array_equal(
    np.asarray(a.scale).view(np.uint16 if np.asarray(a.scale).itemsize == 2 else np.uint32),
    np.asarray(b.scale).view(np.uint16 if np.asarray(b.scale).itemsize == 2 else np.uint32),
  )


@pytest.fixture
def model_file(tmp_path, rng):
  """A small llama-like GGUF file and the float weights it was quantised from."""
  w = {
    "blk.0.attn_q.weight": weights(rng, 64, 64),
    "blk.0.ffn_up.weight": weights(rng, 96, 64),  # [n_out, n_in]
    "blk.0.ffn_down.weight": weights(rng, 64, 96),
  }
  tensors = {name: (q8_bytes(x), T.Q8_0) for name, x in w.items()}
  tensors["blk.0.attn_norm.weight"] = rng.standard_normal(64).astype(np.float32)
  tensors["token_embd.weight"] = rng.standard_normal((40, 64)).astype(np.float16)
  kv = {
    "llama.block_count": (1, gguf.GGUFValueType.UINT32),
    "llama.embedding_length": (64, gguf.GGUFValueType.UINT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, gguf.GGUFValueType.FLOAT32),
    "general.name": ("tiny", gguf.GGUFValueType.STRING),
    "flag": (True, gguf.GGUFValueType.BOOL),
    "strs": (["a", "bc", "def"], gguf.GGUFValueType.ARRAY),
    "offset": (-7, gguf.GGUFValueType.INT64),
  }
  path = tmp_path / "model.gguf"
  write_gguf(path, tensors, kv)
  return path, w, tensors


# ---- loading ------------------------------------------------------------------


def test_q8_0_matrices_bit_equal_to_q8rules_quantize(model_file):
  path, w, _ = model_file
  ckpt = ckpt_gguf.load(path)
  for name, x in w.items():
    a = ckpt[name]
    assert isinstance(a, Q8Array) and isinstance(a.q, np.ndarray)
    assert a.shape == (x.shape[1], x.shape[0]) and a.axis == 0
    assert a.scale.shape == (x.shape[1] // BLOCK, x.shape[0]) and a.scale.dtype == np.float16
    assert a.q.flags.c_contiguous and a.scale.flags.c_contiguous
    assert_q8_equal(a, reference(x))


def test_q8_0_matches_the_raw_blocks(model_file):
  """q = blocks' int8 reshaped (n_out, n_in).T, scale = d reshaped (n_out, n_in/32).T."""
  path, w, _ = model_file
  ckpt = ckpt_gguf.load(path)
  name = "blk.0.ffn_up.weight"
  raw = np.asarray(ckpt.raw(name)).reshape(-1, 34)
  n_out, n_in = w[name].shape
  d = raw[:, :2].copy().view(np.float16).reshape(n_out, n_in // BLOCK)
  qs = raw[:, 2:].copy().view(np.int8).reshape(n_out, n_in)
  a = ckpt[name]
  np.testing.assert_array_equal(a.q, qs.T)
  np.testing.assert_array_equal(a.scale.view(np.uint16), d.T.view(np.uint16))
  g = ckpt.get_tensor(name, layout="gguf")  # numpy order, blocked along the last axis
  assert g.axis == 1
  np.testing.assert_array_equal(g.q, qs)
  np.testing.assert_array_equal(g.scale.view(np.uint16), d.view(np.uint16))
  # and dequantised, the same as llama.cpp's
  np.testing.assert_array_equal(
    np.asarray(q8rules.dequantize(a)), gguf_dequantize(ckpt.raw(name), T.Q8_0).T
  )


def test_float32_scales_are_the_float16_values(model_file):
  path, w, _ = model_file
  ckpt = ckpt_gguf.load(path, scale_dtype=np.float32, dtype=jnp.bfloat16)
  a = ckpt["blk.0.ffn_down.weight"]
  ref = reference(w["blk.0.ffn_down.weight"])
  assert a.scale.dtype == np.float32 and a.dtype == jnp.bfloat16
  np.testing.assert_array_equal(a.scale, np.asarray(ref.scale).astype(np.float32))
  np.testing.assert_array_equal(a.q, np.asarray(ref.q))


def test_stacked_experts(tmp_path, rng):
  """[E, n_out, n_in] -> q (E, n_in, n_out), scale (E, n_in/32, n_out), axis 1."""
  w = weights(rng, 3, 40, 96)
  path = tmp_path / "moe.gguf"
  write_gguf(path, {"blk.0.ffn_up_exps.weight": (q8_bytes(w), T.Q8_0)})
  ckpt = ckpt_gguf.load(path)
  a = ckpt["blk.0.ffn_up_exps.weight"]
  assert (a.shape, a.scale.shape, a.axis) == ((3, 96, 40), (3, 3, 40), 1)
  spec = ckpt.spec("blk.0.ffn_up_exps.weight")
  assert (spec.q.shape, spec.scale.shape, spec.axis) == (a.shape, a.scale.shape, a.axis)
  for e in range(3):
    assert_q8_equal(Q8Array(a.q[e], a.scale[e], axis=0), reference(w[e]))
  np.testing.assert_array_equal(
    np.asarray(q8rules.dequantize(a)),
    np.swapaxes(gguf_dequantize(ckpt.raw("blk.0.ffn_up_exps.weight"), T.Q8_0), -1, -2),
  )
  g = ckpt.get_tensor("blk.0.ffn_up_exps.weight", layout="gguf")
  assert (g.shape, g.scale.shape, g.axis) == ((3, 40, 96), (3, 40, 3), 2)
  np.testing.assert_array_equal(g.q, np.swapaxes(a.q, -1, -2))


def test_float_tensors(tmp_path, rng):
  f32 = rng.standard_normal(64).astype(np.float32)
  f16 = rng.standard_normal((5, 64)).astype(np.float16)
  bf = rng.standard_normal((6, 32)).astype(np.float32)
  path = tmp_path / "floats.gguf"
  write_gguf(
    path,
    {"norm": f32, "embd": f16, "bf": (gguf_quantize(bf, T.BF16), T.BF16), "i": f32.view(np.int32)},
  )
  ckpt = ckpt_gguf.load(path)
  assert ckpt["norm"].dtype == np.float32
  np.testing.assert_array_equal(ckpt["norm"], f32)
  assert ckpt["embd"].dtype == np.float16 and ckpt["embd"].shape == (64, 5)  # (n_in, n_out)
  np.testing.assert_array_equal(ckpt["embd"], f16.T)
  np.testing.assert_array_equal(ckpt.get_tensor("embd", layout="gguf"), f16)
  b = ckpt["bf"]
  assert b.dtype == ml_dtypes.bfloat16 and b.shape == (32, 6)
  want = bf.astype(ml_dtypes.bfloat16).T  # gguf's BF16 rounds to nearest even, as ml_dtypes
  np.testing.assert_array_equal(b.view(np.uint16), want.view(np.uint16))
  np.testing.assert_array_equal(ckpt["i"], f32.view(np.int32))
  assert ckpt.spec("bf").shape == (32, 6) and ckpt.spec("bf").dtype == ml_dtypes.bfloat16


def test_metadata(model_file):
  path, _, _ = model_file
  ckpt = ckpt_gguf.load(path)
  m = ckpt.metadata
  assert ckpt.arch == "llama" == m["general.architecture"]
  assert m["llama.block_count"] == 1 and m["llama.embedding_length"] == 64
  assert m["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
  assert m["general.name"] == "tiny" and m["flag"] is True
  assert m["strs"] == ["a", "bc", "def"] and m["offset"] == -7
  assert not any(k.startswith("GGUF.") for k in m)
  typed = ckpt.typed_metadata
  assert typed["llama.block_count"].type == gguf.GGUFValueType.UINT32
  assert typed["offset"].type == gguf.GGUFValueType.INT64
  assert typed["strs"].sub_type == gguf.GGUFValueType.STRING
  assert list(ckpt) == [
    "blk.0.attn_q.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
    "blk.0.attn_norm.weight",
    "token_embd.weight",
  ]
  assert ckpt.tensor_type("blk.0.attn_q.weight") == T.Q8_0
  assert ckpt.gguf_shape("blk.0.ffn_up.weight") == (96, 64)


def test_lazy_access_repacks_only_what_is_asked(model_file):
  path, _, _ = model_file
  ckpt = ckpt_gguf.load(path)
  assert not ckpt.repacked
  ckpt.spec("blk.0.ffn_up.weight")  # shapes come from the header
  assert len(ckpt) == 5 and "token_embd.weight" in ckpt and not ckpt.repacked
  ckpt["blk.0.ffn_down.weight"]
  assert dict(ckpt.repacked) == {"blk.0.ffn_down.weight": 1}
  everything = ckpt.load_all()
  assert list(everything) == list(ckpt) and sum(ckpt.repacked.values()) == 6
  ckpt.close()
  assert isinstance(everything["blk.0.attn_q.weight"].q, np.ndarray)  # owned copies
  everything["blk.0.attn_q.weight"].q.sum()
  with pytest.raises(CheckpointError, match="closed"):
    ckpt["blk.0.attn_q.weight"]


def test_one_tensor_of_a_huge_sparse_file(tmp_path, rng):
  """A 2.3 GB Q8_0 tensor (sparse on disk) stays unread when a small one is loaded."""
  path = tmp_path / "huge.gguf"
  small = weights(rng, 8, 64)
  big_shape = (32768, 65536)  # [n_out, n_in]
  big_bytes = (*big_shape[:-1], big_shape[-1] // BLOCK * 34)
  writer = gguf.GGUFWriter(path, "llama")
  raw = q8_bytes(small)
  writer.add_tensor_info("small", raw.shape, np.uint8, raw.nbytes, raw_dtype=T.Q8_0)
  n_big = int(np.prod(big_bytes))
  writer.add_tensor_info("big", big_bytes, np.uint8, n_big, raw_dtype=T.Q8_0)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  writer.write_tensor_data(raw)
  end = writer.fout[0].tell() + n_big
  writer.close()
  os.truncate(path, end)  # the big tensor's blocks: a hole, never written
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  ckpt = ckpt_gguf.load(path)
  assert ckpt.spec("big").q.shape == big_shape[::-1]
  assert_q8_equal(ckpt["small"], reference(small))
  grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
  assert grown_kib < 512 * 1024
  assert dict(ckpt.repacked) == {"small": 1}


# ---- saving -------------------------------------------------------------------


def test_save_writes_llama_cpp_bytes(tmp_path, rng):
  """Q8Arrays quantised by q8rules -> the same bytes gguf.quants writes."""
  w = {"a.weight": weights(rng, 48, 64), "b.weight": weights(rng, 64, 128)}
  norm = rng.standard_normal(48).astype(np.float32)
  half = rng.standard_normal((3, 64)).astype(np.float16)  # our layout: (K, N)
  tensors = {name: reference(x) for name, x in w.items()}
  tensors["n.weight"] = norm
  tensors["h.weight"] = half
  path = tmp_path / "out.gguf"
  ckpt_gguf.save(
    path, tensors, arch="qwen2", metadata={"qwen2.block_count": 2, "general.name": "t"}
  )
  reader = gguf.GGUFReader(path)
  by_name = {t.name: t for t in reader.tensors}
  for name, x in w.items():
    t = by_name[name]
    assert t.tensor_type == T.Q8_0
    assert tuple(t.shape) == (x.shape[1], x.shape[0])  # ggml ne order
    np.testing.assert_array_equal(t.data, q8_bytes(x))
  assert by_name["n.weight"].tensor_type == T.F32
  np.testing.assert_array_equal(by_name["n.weight"].data, norm)
  assert by_name["h.weight"].tensor_type == T.F16
  np.testing.assert_array_equal(by_name["h.weight"].data, half.T)  # [n_out, n_in] in the file
  fields = reader.fields
  assert fields["general.architecture"].contents() == "qwen2"
  assert fields["qwen2.block_count"].contents() == 2
  assert fields["qwen2.block_count"].types == [gguf.GGUFValueType.UINT32]
  assert not list(tmp_path.glob(".*.tmp"))


def test_load_save_round_trip_is_byte_identical(model_file, tmp_path, rng):
  path, _, tensors = model_file
  extra = tmp_path / "extra.gguf"
  bf = rng.standard_normal((4, 32)).astype(np.float32)
  exps = weights(rng, 2, 8, 64)
  write_gguf(
    extra,
    {
      **tensors,
      "bf": (gguf_quantize(bf, T.BF16), T.BF16),
      "exps": (q8_bytes(exps), T.Q8_0),
    },
  )
  for src in (path, extra):
    for layout, scale_dtype in (("kernel", np.float16), ("gguf", np.float32)):
      ckpt = ckpt_gguf.load(src, layout=layout, scale_dtype=scale_dtype)
      out = tmp_path / f"again-{layout}.gguf"
      ckpt_gguf.save(out, ckpt, metadata=ckpt.typed_metadata, layout=layout)
      original, again = gguf.GGUFReader(src), gguf.GGUFReader(out)
      assert [t.name for t in original.tensors] == [t.name for t in again.tensors]
      for t0, t1 in zip(original.tensors, again.tensors, strict=True):
        assert t0.tensor_type == t1.tensor_type and list(t0.shape) == list(t1.shape)
        np.testing.assert_array_equal(
          np.asarray(t0.data).view(np.uint8), np.asarray(t1.data).view(np.uint8)
        )
      assert src.read_bytes() == out.read_bytes()  # header, metadata and all


def test_save_refuses_float32_scales_that_are_not_float16(tmp_path, rng):
  w = weights(rng, 32, 64).T
  a = q8rules.quantize(w, axis=0, scale_dtype=jnp.float32)
  path = tmp_path / "x.gguf"
  with pytest.raises(CheckpointError, match=r"'blk\.0\.w'.*not float16 values.*round_scales"):
    ckpt_gguf.save(path, {"blk.0.w": a})
  assert not path.exists() and not list(tmp_path.iterdir())  # nothing half written
  ckpt_gguf.save(path, {"blk.0.w": a}, round_scales=True)
  back = ckpt_gguf.load(path)["blk.0.w"]
  np.testing.assert_array_equal(back.q, np.asarray(a.q))
  np.testing.assert_array_equal(back.scale, np.asarray(a.scale).astype(np.float16))
  # float32 scales holding float16 values are written as they are
  exact = Q8Array(q=a.q, scale=jnp.asarray(back.scale, jnp.float32), axis=0)
  ckpt_gguf.save(tmp_path / "y.gguf", {"blk.0.w": exact})
  assert (tmp_path / "y.gguf").read_bytes() == path.read_bytes()


@pytest.mark.parametrize(
  "value, match",
  [
    (lambda a: Q8Array(q=a.q.T, scale=a.scale.T, axis=1), "blocked along axis 1"),
    (lambda a: np.zeros((1, 1, 1, 1, 2), np.float32) + 1, "1 to 4 dimensions"),
    (lambda a: np.ones(3, bool), "dtype bool has no GGUF tensor type"),
    (lambda a: np.float32(2.5), "1 to 4 dimensions"),
  ],
)
def test_save_refuses_what_gguf_cannot_hold(tmp_path, rng, value, match):
  a = reference(weights(rng, 16, 64))
  path = tmp_path / "bad.gguf"
  with pytest.raises(CheckpointError, match=match) as e:
    ckpt_gguf.save(path, {"fine": a, "the.bad.one": value(a)})
  assert "'the.bad.one'" in str(e.value) and str(path) in str(e.value)
  assert not list(tmp_path.iterdir())


# ---- bad files ----------------------------------------------------------------


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError):
    ckpt_gguf.load(tmp_path / "nope.gguf")


def test_wrong_magic(tmp_path, model_file):
  path, _, _ = model_file
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGML" + path.read_bytes()[4:])
  with pytest.raises(CheckpointError, match=r"bad\.gguf: not a GGUF file.*b'GGML'"):
    ckpt_gguf.load(bad)
  tiny = tmp_path / "tiny.gguf"
  tiny.write_bytes(b"GG")
  with pytest.raises(CheckpointError, match="tiny.gguf: not a GGUF file"):
    ckpt_gguf.load(tiny)


@pytest.mark.parametrize("keep", [8, 30, 200])
def test_truncated_header(tmp_path, model_file, keep):
  path, _, _ = model_file
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(path.read_bytes()[:keep])
  with pytest.raises(CheckpointError, match=r"cut\.gguf: cannot read the GGUF header"):
    ckpt_gguf.load(cut)


def test_truncated_data(tmp_path, model_file):
  path, _, _ = model_file
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(path.read_bytes()[:-100])
  with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor 'token_embd\.weight'.*truncated"):
    ckpt_gguf.load(cut)


def test_tensor_whose_bytes_do_not_match_its_shape(tmp_path, model_file):
  """The header says 128 rows where the data holds 96: caught, the tensor named."""
  path, _, _ = model_file
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(path.read_bytes())
  reader = gguf.GGUFReader(bad, "r+")
  dims = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight").field.parts[3]
  assert list(dims) == [64, 96]
  dims[1] = 128
  reader.data.flush()
  del reader, dims
  with pytest.raises(
    CheckpointError, match=r"bad\.gguf: the byte count of tensor 'blk\.0\.ffn_up\.weight'"
  ):
    ckpt_gguf.load(bad)


def test_rows_not_whole_blocks(tmp_path, model_file):
  path, _, _ = model_file
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(path.read_bytes())
  reader = gguf.GGUFReader(bad, "r+")
  reader.tensors[0].field.parts[3][0] = 48  # ne[0] of blk.0.attn_q.weight
  reader.data.flush()
  del reader
  with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q\.weight'.*not a whole number"):
    ckpt_gguf.load(bad)


def test_unsupported_quant_types(tmp_path, rng):
  """A type gguf.quants cannot dequantize is refused, named, whatever the policy; the others
  are requantized to Q8_0 by default, or dequantized to float32 on request."""
  w4 = weights(rng, 16, 64)
  path = tmp_path / "q4.gguf"
  q8_1 = rng.integers(0, 256, (4, 2 * 40), dtype=np.uint8)  # Q8_1: gguf cannot dequantize it
  write_gguf(
    path,
    {
      "ok": (q8_bytes(w4), T.Q8_0),
      "q4": (gguf_quantize(w4, T.Q4_0), T.Q4_0),
      "q81": (q8_1, T.Q8_1),
    },
  )
  for dequantize_other in (False, True):
    with pytest.raises(
      CheckpointError,
      match=r"(?s)q4\.gguf: 1 tensor\(s\) cannot be served.*'q81': Q8_1 \(gguf.quants cannot",
    ):
      ckpt_gguf.load(path, dequantize_other=dequantize_other)
  only_q4 = tmp_path / "only_q4.gguf"
  raw4 = gguf_quantize(w4, T.Q4_0)
  write_gguf(only_q4, {"ok": (q8_bytes(w4), T.Q8_0), "q4": (raw4, T.Q4_0)})
  ckpt = ckpt_gguf.load(only_q4, dequantize_other=True)
  assert ckpt.spec("q4").shape == (64, 16)
  q4 = ckpt["q4"]
  assert q4.dtype == np.float32
  np.testing.assert_array_equal(q4, gguf_dequantize(raw4, T.Q4_0).T)
  served = ckpt_gguf.load(only_q4)["q4"]
  assert isinstance(served, Q8Array) and served.q.shape == (64, 16)


def test_unknown_tensor_name(model_file):
  path, _, _ = model_file
  with pytest.raises(KeyError, match="blk.9"):
    ckpt_gguf.load(path)["blk.9.ffn_up.weight"]
