"""GGUF tensors of other types served as Q8_0 (q8rules/checkpoint/gguf/requant.py): the blocks
are `gguf.quants.quantize(gguf.quants.dequantize(...), Q8_0)` bit for bit, for every quantized
type gguf-py dequantizes and for F32 / F16 / BF16 under `quantize='q8_0'`; every read path of
the reader (a tensor, its spec, a region, a stack, a fused group) serves them; bad blocks and
non-finite weights are refused with the file, tensor and row named."""

from __future__ import annotations

from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import gguf as ckpt_gguf
from q8rules.checkpoint.gguf import requant
from q8rules.checkpoint.gguf.header import Tensor
from q8rules.checkpoint.gguf.layouts import dequantizable
from q8rules.q8_0 import Q8Array
from tests._utils import copy_gguf, weights, write_gguf

QUANTIZED = [t for t in T if requant.is_quantized(t) and dequantizable(t)]
"""Every quantized type (not Q8_0) that gguf.quants dequantizes: IQ*, TQ*, MXFP4 included."""


def random_blocks(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
  """`rows` random rows of `cols` values of `qtype` whose values decode finite: random bytes
  (the scales' float16 bits among them), the rows that decode to inf or NaN drawn again."""
  block, size = GGML_QUANT_SIZES[qtype]
  row_bytes = cols // block * size
  out = np.empty((0, row_bytes), np.uint8)
  while len(out) < rows:
    raw = rng.integers(0, 256, (2 * rows, row_bytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
      x = gguf_dequantize(raw, qtype)
      amax = np.abs(x).reshape(len(x), -1, 32).max(axis=-1)  # per Q8_0 block
      # finite, a Q8_0 scale float16 holds, and not so small that 1 / d overflows
      fits = (amax < 127 * 65504) & ((amax == 0) | (amax > 1e-30))
      ok = np.isfinite(x).all(axis=-1) & fits.all(axis=-1)
    out = np.concatenate([out, raw[ok]])
  return out[:rows]


def tensor(name: str, qtype: T, shape: tuple[int, ...], data: np.ndarray) -> Tensor:
  return Tensor(name, qtype, shape, 0, data)


def expected(data: np.ndarray, qtype: T) -> np.ndarray:
  x = np.asarray(gguf_dequantize(data, qtype), np.float32)
  return gguf_quantize(x, T.Q8_0)


@pytest.mark.parametrize(
  "qtype",
  [pytest.param(t, marks=pytest.mark.slow) if t == T.MXFP4 else t for t in QUANTIZED],
  ids=lambda t: t.name,
)
def test_requantized_blocks_are_gguf_quants(rng, qtype):
  cols = 512  # whole blocks of every type (32 and 256)
  data = random_blocks(rng, qtype, 6, cols)
  got = requant.q8_0_blocks(tensor("w", qtype, (6, cols), data))
  assert got.shape == (6, cols // 32 * 34)
  np.testing.assert_array_equal(got, expected(data, qtype))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_quantized_floats_are_gguf_quants(rng, qtype):
  """F32 / F16 / BF16 weights to Q8_0: bit-equal to gguf.quants (llama.cpp's
  quantize_row_q8_0_ref), with rounding ties and an all-zero block (d = 0) in them."""
  w = weights(rng, 5, 96).astype(np.float32)
  w[1, :32] = 0.0  # a zero block
  w[2, :32] = np.arange(-16, 16) * 0.5  # amax 8: steps of 8/127, with values on .5 of a step
  w[3, 32:64] = np.linspace(-127, 127, 32) / 127 * 3.0
  dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: ml_dtypes.bfloat16}[qtype]
  typed = w.astype(dtype)
  data = typed.view(np.uint8).reshape(5, -1) if qtype == T.BF16 else typed
  got = requant.q8_0_blocks(tensor("blk.0.ffn_up.weight", qtype, (5, 96), data))
  np.testing.assert_array_equal(got, gguf_quantize(typed.astype(np.float32), T.Q8_0))
  assert (got[1, :2] == 0).all()  # d = 0 for the zero block


def test_rank3_and_chunking(rng, monkeypatch):
  """A stacked (experts, rows, cols) tensor, requantized a few rows at a time, is the same as
  in one go."""
  data = random_blocks(rng, T.Q4_K, 3 * 4, 256).reshape(3, 4, -1)
  monkeypatch.setattr(requant, "CHUNK_VALUES", 256 * 3)  # 3 rows a chunk, across the experts
  got = requant.q8_0_blocks(tensor("e", T.Q4_K, (3, 4, 256), data))
  assert got.shape == (3, 4, 8 * 34)
  np.testing.assert_array_equal(got.reshape(12, -1), expected(data.reshape(12, -1), T.Q4_K))


def test_corrupt_block_is_refused_with_its_row(rng):
  data = random_blocks(rng, T.Q4_0, 4, 64)
  data[2, 18:20] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # row 2, block 1's d
  with pytest.raises(CheckpointError, match=r"f\.gguf: tensor 'w' \(Q4_0.*row 2.*corrupt block"):
    requant.q8_0_blocks(tensor("w", T.Q4_0, (4, 64), data), path="f.gguf")


def test_non_finite_weight_is_refused(rng):
  w = weights(rng, 3, 64).astype(np.float16)
  w[1, 5] = np.nan
  with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q\.weight' \(F16.*row 1.*non-finite"):
    requant.q8_0_blocks(tensor("blk.0.attn_q.weight", T.F16, (3, 64), w))


def test_block_beyond_float16_scales_is_refused():
  w = np.ones((3, 64), np.float32)
  w[2, 40] = 127 * 70000.0  # its Q8_0 scale, amax / 127, overflows float16
  with pytest.raises(CheckpointError, match=r"row 2 holds a value beyond 127 times float16"):
    requant.q8_0_blocks(tensor("w", T.F32, (3, 64), w))


def test_rows_not_whole_blocks():
  w = np.zeros((2, 48), np.float32)
  with pytest.raises(CheckpointError, match=r"rows of 48 values are not whole Q8_0 blocks"):
    requant.q8_0_blocks(tensor("w", T.F32, (2, 48), w))


@pytest.mark.parametrize(
  ("name", "shape", "quantized"),
  [
    ("blk.0.attn_q.weight", (64, 32), True),
    ("token_embd.weight", (100, 64), True),
    ("output.weight", (100, 64), True),
    ("blk.0.attn_norm.weight", (64,), False),
    ("blk.0.attn_q_norm.weight", (4, 64), False),  # a norm, whatever its rank
    ("blk.0.attn_q.bias", (64, 32), False),
    ("blk.0.ffn_gate_inp.weight", (8, 64), False),  # a MoE router
    ("blk.0.attn_q.weight", (64, 48), False),  # rows not whole blocks
  ],
)
def test_which_float_tensors_quantize(name, shape, quantized):
  assert requant.quantizes_float(name, T.F16, shape) is quantized
  policy = requant.TypePolicy(quantize="q8_0")
  t = tensor(name, T.F16, shape, np.zeros(shape, np.float16))
  assert (policy.served_type(t) == T.Q8_0) is quantized
  assert requant.TypePolicy().served_type(t) == T.F16


def test_policy_served_types():
  q4 = tensor("w", T.Q4_K, (4, 256), np.zeros((4, 144), np.uint8))
  vec = tensor("v", T.Q4_0, (64,), np.zeros((36,), np.uint8))
  assert requant.TypePolicy().served_type(q4) == T.Q8_0
  assert requant.TypePolicy(dequantize_other=True).served_type(q4) == T.F32
  assert requant.TypePolicy().served_type(vec) == T.F32  # a vector is no matrix: float32
  assert requant.TypePolicy().requantized([q4, vec]) == {"Q4_K": 1}
  assert requant.describe_requantized(requant.TypePolicy().requantized([q4, q4])) == (
    "2 tensors requantized to Q8_0 (2 Q4_K)"
  )
  with pytest.raises(ValueError, match="quantize must be one of"):
    requant.TypePolicy(quantize="q4_0")


@pytest.fixture
def mixed_file(tmp_path, rng):
  """Two layers whose q / k / v are Q4_K, Q5_0 and Q8_0 (as a Q4_K_M file mixes them), an F16
  matrix, an F32 norm."""
  tensors, raw = {}, {}
  for layer in range(2):
    for proj, qtype in (("attn_q", T.Q4_K), ("attn_k", T.Q5_0), ("attn_v", T.Q8_0)):
      name = f"blk.{layer}.{proj}.weight"
      t = T.Q6_K if (layer, proj) == (1, "attn_q") else qtype  # a type that changes by layer
      raw[name] = (random_blocks(rng, t, 64, 256), t)
      tensors[name] = raw[name]
  tensors["blk.0.ffn_up.weight"] = weights(rng, 32, 256).astype(np.float16)
  tensors["blk.0.attn_norm.weight"] = weights(rng, 256).astype(np.float32)
  path = tmp_path / "mixed.gguf"
  write_gguf(path, tensors)
  return path, raw, tensors


def test_reader_serves_every_quantized_tensor_as_q8(mixed_file):
  path, raw, tensors = mixed_file
  ckpt = ckpt_gguf.load(path)
  assert ckpt.requantized == {"Q4_K": 1, "Q6_K": 1, "Q5_0": 2}
  assert ckpt.describe_requantized() == "4 tensors requantized to Q8_0 (2 Q5_0, 1 Q4_K, 1 Q6_K)"
  direct = ckpt_gguf.load(path, layout="gguf")
  for name, (data, qtype) in raw.items():
    value, spec = ckpt[name], ckpt.spec(name)
    assert isinstance(value, Q8Array) and value.q.shape == spec.q.shape == (256, 64)
    assert ckpt.served_type(name) == T.Q8_0 and ckpt.tensor_type(name) == qtype
    blocks = (data if qtype == T.Q8_0 else expected(data, qtype)).reshape(64, 8, 34)
    g = direct[name]  # the gguf layout: the blocks' own order
    np.testing.assert_array_equal(g.q, blocks[..., 2:].view(np.int8).reshape(64, 256))
    np.testing.assert_array_equal(g.scale, blocks[..., :2].copy().view(np.float16)[..., 0])
    np.testing.assert_array_equal(value.q, g.q.T)
    region = ckpt.read_region(name, (slice(64, 128), slice(8, 24)))
    np.testing.assert_array_equal(region.q, value.q[64:128, 8:24])
    np.testing.assert_array_equal(region.scale, value.scale[2:4, 8:24])
  assert isinstance(ckpt["blk.0.ffn_up.weight"], np.ndarray)  # F16 stays F16 by default
  assert ckpt["blk.0.ffn_up.weight"].dtype == np.float16


def test_reader_stacks_and_fuses_requantized_tensors(mixed_file):
  path, _, _ = mixed_file
  ckpt = ckpt_gguf.load(path)
  names = ["blk.0.attn_q.weight", "blk.1.attn_q.weight"]  # Q4_K, then Q6_K
  stacked = ckpt.get_stacked(names)
  for i, n in enumerate(names):
    np.testing.assert_array_equal(stacked.q[i], ckpt[n].q)
    np.testing.assert_array_equal(stacked.scale[i], ckpt[n].scale)
  groups = [[f"blk.{i}.attn_{p}.weight" for i in range(2)] for p in "qkv"]
  fused = ckpt.get_fused(groups)
  assert fused.q.shape == (2, 256, 3 * 64)
  for j, g in enumerate(groups):
    for i, n in enumerate(g):
      np.testing.assert_array_equal(fused.q[i][:, 64 * j : 64 * (j + 1)], ckpt[n].q)


def test_quantize_q8_0_serves_float_matrices(mixed_file):
  path, _, tensors = mixed_file
  ckpt = ckpt_gguf.load(path, quantize="q8_0")
  up = ckpt["blk.0.ffn_up.weight"]
  assert isinstance(up, Q8Array)
  w = tensors["blk.0.ffn_up.weight"].astype(np.float32)
  blocks = gguf_quantize(w, T.Q8_0).reshape(32, 8, 34)
  np.testing.assert_array_equal(up.q.T, blocks[..., 2:].view(np.int8).reshape(32, 256))
  assert ckpt["blk.0.attn_norm.weight"].dtype == np.float32  # norms stay float
  assert ckpt.requantized["F16"] == 1


def test_load_gguf_serves_a_quantized_file_as_its_q8_0_twin(tmp_path, rng):
  """load_gguf of the tiny llama with its matrices Q4_0 / Q6_K / Q5_1: every one served as
  Q8_0, params and logits bit-equal to the same model written with the requantized blocks as a
  Q8_0 file (what `llama-quantize --allow-requantize` would write)."""
  import jax  # noqa: PLC0415

  import q8rules  # noqa: PLC0415

  src = Path(__file__).parent / "data" / "gguf_models" / "tiny-llama-f32.gguf"
  types: dict[str, T] = {}

  def quantized(t):  # t: a gguf.ReaderTensor of the F32 file
    w = np.asarray(t.data)
    if w.ndim != 2 or "norm" in t.name:
      return w
    qtype = T.Q6_K if w.shape[1] % 256 == 0 else (T.Q5_1 if "attn_v" in t.name else T.Q4_0)
    types[t.name] = qtype
    if qtype == T.Q6_K:  # gguf-py does not quantize K-quants: random blocks of that shape
      return random_blocks(rng, qtype, *w.shape), qtype
    return gguf_quantize(w, qtype), qtype

  def requantized(t):
    if t.name not in types:
      return np.asarray(t.data), t.tensor_type
    return expected(np.asarray(t.data), types[t.name]), T.Q8_0

  q_path, q8_path = tmp_path / "mixed.gguf", tmp_path / "q8.gguf"
  copy_gguf(src, q_path, quantized)
  copy_gguf(q_path, q8_path, requantized)
  a = q8rules.load_gguf(q_path, progress=False, dtype=np.float32)
  b = q8rules.load_gguf(q8_path, progress=False, dtype=np.float32)
  assert sum(a.requantized.values()) == len(types) and not b.requantized
  assert set(a.requantized) == {t.name for t in types.values()}
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ids = [1, 5, 9, 3, 7]
  np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_gguf_writer_roundtrip_names_in_errors(tmp_path, rng):
  """A corrupt block in a file: the load names the file, the tensor and the row."""
  data = random_blocks(rng, T.Q5_0, 8, 64)
  data[5, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
  path = tmp_path / "corrupt.gguf"
  write_gguf(path, {"blk.0.attn_q.weight": (data, T.Q5_0)})
  ckpt = ckpt_gguf.load(path)
  with pytest.raises(
    CheckpointError, match=r"corrupt\.gguf: tensor 'blk\.0\.attn_q\.weight'.*row 5"
  ):
    ckpt["blk.0.attn_q.weight"]
  assert isinstance(gguf.GGUFReader(path), gguf.GGUFReader)


def test_corrupt_block_in_a_stack_or_fused_group_names_its_tensor(tmp_path, rng):
  """Stacks and fused groups requantize in the repack's pass: a corrupt block in layer 1's
  attn_k is still refused naming the file, that tensor and its row."""
  tensors = {
    f"blk.{i}.attn_{p}.weight": (random_blocks(rng, T.Q4_K, 64, 256), T.Q4_K)
    for i in range(2)
    for p in "qk"
  }
  bad = tensors["blk.1.attn_k.weight"][0]
  bad[9, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # row 9's super-block d
  path = tmp_path / "corrupt.gguf"
  write_gguf(path, tensors)
  ckpt = ckpt_gguf.load(path)
  stack = ["blk.0.attn_k.weight", "blk.1.attn_k.weight"]
  match = r"corrupt\.gguf: tensor 'blk\.1\.attn_k\.weight'.*row 9.*corrupt block"
  with pytest.raises(CheckpointError, match=match):
    ckpt.get_stacked(stack)
  with pytest.raises(CheckpointError, match=match):
    ckpt.get_fused([["blk.0.attn_q.weight", "blk.1.attn_q.weight"], stack])
