"""The GGUF loader's Q8_0 repack: the native library's transposing read of the file's blocks
(`q8rules.kernels.native.repack.repack_q8_transposed`) against numpy, and `GGUFCheckpoint.get_stacked` (per-layer
tensors repacked straight into one stacked Q8Array) against stacking them one by one."""

from __future__ import annotations

import platform

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import gguf as ckpt_gguf
from q8rules.checkpoint.gguf.layouts import block_dtype
from q8rules.checkpoint.host_buffers import is_aligned
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import repack as native_repack
from tests._utils import weights, write_gguf


def random_blocks(rng, batch: int, rows: int, nb: int) -> np.ndarray:
  """batch x rows x nb random 34-byte Q8_0 blocks (float16 scale, 32 int8 values)."""
  blocks = np.empty(batch * rows * nb, block_dtype("<"))
  blocks["d"] = rng.uniform(1e-3, 1e-2, blocks.shape).astype(np.float16)
  blocks["qs"] = rng.integers(-127, 128, (*blocks.shape, 32), dtype=np.int8)
  return blocks.view(np.uint8)


@pytest.mark.parametrize(
  "batch,rows,nb",
  # the last two over REPACK_THREAD_BYTES, so the work is split over the CPUs: 2 tensors, one
  # to each thread; one tensor's rows, in runs of 64 (1000 rows: uneven ranges, and 8 rows
  # past the last multiple of 16)
  [(1, 16, 1), (1, 40, 3), (3, 33, 2), (2, 1, 1), (1, 64, 4), (2, 1000, 34), (1, 1000, 34)],
)
@pytest.mark.parametrize("scales", [True, False])
def test_native_repack_is_numpys_transpose(rng, batch, rows, nb, scales):
  raw = random_blocks(rng, batch, rows, nb)
  out = np.full((batch, nb * 32, rows), 99, np.int8)
  scale_out = np.full((batch, nb, rows), 7, np.float16) if scales else None
  ran = native_repack.repack_q8_transposed(raw, out, scale_out)
  assert ran == native_lib.available()  # the library runs exactly where it is available
  if not ran:
    pytest.skip(f"native library unavailable: {native_lib.unavailable_reason()}")
  blocks = raw.view(block_dtype("<"))
  qs = blocks["qs"].reshape(batch, rows, nb * 32)
  np.testing.assert_array_equal(out, np.swapaxes(qs, -1, -2))
  if scales:  # bit for bit
    d = blocks["d"].reshape(batch, rows, nb)
    np.testing.assert_array_equal(scale_out.view(np.uint16), np.swapaxes(d, -1, -2).view(np.uint16))


def test_native_repack_refuses_wrong_sizes(rng):
  if not native_lib.available():
    pytest.skip(f"native library unavailable: {native_lib.unavailable_reason()}")
  raw = random_blocks(rng, 1, 16, 2)
  with pytest.raises(ValueError, match="C-contiguous uint8 bytes"):
    native_repack.repack_q8_transposed(raw, np.empty((1, 64, 17), np.int8))
  out = np.empty((1, 64, 16), np.int8)
  with pytest.raises(ValueError, match=r"float16 scales \(1, 2, 16\)"):
    native_repack.repack_q8_transposed(raw, out, np.empty((1, 2, 16), np.float32))
  with pytest.raises(ValueError, match=r"float16 scales \(1, 2, 16\)"):
    native_repack.repack_q8_transposed(raw, out, np.empty((1, 3, 16), np.float16))
  two = np.empty((2, 64, 16), np.int8)  # one array per tensor: as many as out has, each whole
  with pytest.raises(ValueError, match="2 tensor"):
    native_repack.repack_q8_transposed([raw, raw, raw], two)
  with pytest.raises(ValueError, match="2 tensor"):
    native_repack.repack_q8_transposed([raw, raw[:-34]], two)


def test_native_repack_of_separate_tensors_into_a_stack_of_column_ranges(rng, monkeypatch):
  """Tensors given one array each (a stack's layers, each a view of the file's mapping), in one
  call, into a column range of every layer of a wider stack (load_gguf's fused gate | up): the
  threads take whole tensors (REPACK_THREAD_BYTES lowered so that they run)."""
  if not native_lib.available():
    pytest.skip(f"native library unavailable: {native_lib.unavailable_reason()}")
  monkeypatch.setattr(native_repack, "REPACK_THREAD_BYTES", 1)
  raws = [random_blocks(rng, 1, 40, 3) for _ in range(5)]
  wide = np.full((5, 96, 100), 99, np.int8)
  wide_scale = np.full((5, 3, 100), 7, np.float16)
  assert native_repack.repack_q8_transposed(raws, wide[:, :, 30:70], wide_scale[:, :, 30:70])
  for i, raw in enumerate(raws):
    blocks = raw.view(block_dtype("<"))
    np.testing.assert_array_equal(wide[i, :, 30:70], blocks["qs"].reshape(40, 96).T)
    d = blocks["d"].reshape(40, 3).T
    np.testing.assert_array_equal(wide_scale[i, :, 30:70].view(np.uint16), d.view(np.uint16))
  assert (wide[:, :, :30] == 99).all() and (wide[:, :, 70:] == 99).all()
  assert (wide_scale[:, :, :30] == 7).all() and (wide_scale[:, :, 70:] == 7).all()


def q8_bytes(w: np.ndarray) -> np.ndarray:
  from gguf.quants import quantize

  return quantize(w, T.Q8_0)


def test_get_stacked_equals_stacking(tmp_path, rng):
  tensors = {f"blk.{i}.ffn_up.weight": (q8_bytes(weights(rng, 40, 96)), T.Q8_0) for i in range(3)}
  tensors["blk.0.ffn_down.weight"] = (q8_bytes(weights(rng, 96, 64)), T.Q8_0)
  path = tmp_path / "m.gguf"
  write_gguf(path, tensors)
  ckpt = ckpt_gguf.load(path)
  names = [f"blk.{i}.ffn_up.weight" for i in range(3)]
  got = ckpt.get_stacked(names)
  assert {n: ckpt.repacked[n] for n in names} == dict.fromkeys(names, 1)
  parts = [ckpt[n] for n in names]
  np.testing.assert_array_equal(got.q, np.stack([p.q for p in parts]))
  np.testing.assert_array_equal(got.scale, np.stack([p.scale for p in parts]))
  assert (got.axis, got.dtype) == (parts[0].axis, parts[0].dtype)
  with pytest.raises(CheckpointError, match="cannot be stacked: they have 2 shapes"):
    ckpt.get_stacked([*names, "blk.0.ffn_down.weight"])


def test_native_repack_into_a_column_range(rng):
  """The repack writes a column range of a wider matrix (load_gguf's fused q | k | v and
  gate | up) and leaves the other columns alone."""
  if not native_lib.available():
    pytest.skip(f"native library unavailable: {native_lib.unavailable_reason()}")
  raw = random_blocks(rng, 1, 40, 3)
  wide = np.full((1, 96, 100), 99, np.int8)
  wide_scale = np.full((1, 3, 100), 7, np.float16)
  assert native_repack.repack_q8_transposed(raw, wide[:, :, 30:70], wide_scale[:, :, 30:70])
  blocks = raw.view(block_dtype("<"))
  qs = blocks["qs"].reshape(1, 40, 96)
  np.testing.assert_array_equal(wide[:, :, 30:70], np.swapaxes(qs, -1, -2))
  assert (wide[:, :, :30] == 99).all() and (wide[:, :, 70:] == 99).all()
  d = blocks["d"].reshape(1, 40, 3)
  np.testing.assert_array_equal(wide_scale[:, :, 30:70], np.swapaxes(d, -1, -2))
  assert (wide_scale[:, :, :30] == 7).all() and (wide_scale[:, :, 70:] == 7).all()


@pytest.mark.parametrize("native", [True, False])
def test_get_fused_equals_concatenating_the_stacks(tmp_path, rng, monkeypatch, native):
  """`get_fused` (each member's per-layer tensors straight into its columns) equals
  `get_stacked` of each member concatenated along N, with the native repack and without it
  (numpy's gather and XLA's transpose, what a host without the library runs)."""
  members = {"attn_q": 64, "attn_k": 32, "attn_v": 32}
  tensors = {
    f"blk.{i}.{m}.weight": (q8_bytes(weights(rng, rows, 96)), T.Q8_0)
    for i in range(3)
    for m, rows in members.items()
  }
  path = tmp_path / "m.gguf"
  write_gguf(path, tensors)
  ckpt = ckpt_gguf.load(path)
  groups = [[f"blk.{i}.{m}.weight" for i in range(3)] for m in members]
  stacks = [ckpt.get_stacked(g) for g in groups]
  if not native:
    monkeypatch.setattr(native_repack, "repack_q8_transposed", lambda *a, **k: False)
  got = ckpt.get_fused(groups)
  assert got.q.shape == (3, 96, 128) and got.scale.shape == (3, 3, 128)
  assert got.axis == stacks[0].axis and got.dtype == stacks[0].dtype
  np.testing.assert_array_equal(got.q, np.concatenate([s.q for s in stacks], axis=-1))
  np.testing.assert_array_equal(got.scale, np.concatenate([s.scale for s in stacks], axis=-1))
  with pytest.raises(CheckpointError, match="stacks of \\[2, 3\\] tensors cannot be fused"):
    ckpt.get_fused([groups[0], groups[1][:2]])  # members of other lengths


def test_read_tensors_reach_the_device_without_a_copy(tmp_path, rng):
  """The reader's arrays start on a 64-byte boundary (`checkpoint.host_buffers`), so on the
  CPU backend `jax.device_put` adopts them (the param is the reader's buffer: no second copy
  at load); on an accelerator the transfer copies, as any host -> device transfer does."""
  tensors = {
    "blk.0.ffn_up.weight": (q8_bytes(weights(rng, 40, 96)), T.Q8_0),
    "blk.0.ffn_norm.weight": weights(rng, 1, 96)[0],
  }
  write_gguf(tmp_path / "m.gguf", tensors)
  ckpt = ckpt_gguf.load(tmp_path / "m.gguf")
  q8, norm = ckpt["blk.0.ffn_up.weight"], ckpt["blk.0.ffn_norm.weight"]
  for host in (q8.q, q8.scale, norm):
    assert is_aligned(host)
    aliased = jax.device_put(host).unsafe_buffer_pointer() == host.ctypes.data
    assert aliased == (jax.default_backend() == "cpu")


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_repack_loads_and_runs_on_an_accelerator_host(rng, monkeypatch, backend):
  """On a host whose JAX default backend is a GPU or TPU the native library still loads, and a
  GGUF file's Q8_0 blocks take the native repack (the same bytes as numpy's transpose), not
  the slow path. The default backend is faked; the library is loaded afresh under it."""
  if platform.machine().lower() not in native_lib.MACHINES:
    pytest.skip(f"the native library does not build on {platform.machine()}")
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  native_lib.reset()
  try:
    assert native_lib.available(), native_lib.unavailable_reason()
    raw = random_blocks(rng, 2, 40, 3)
    out = np.zeros((2, 96, 40), np.int8)
    scale_out = np.zeros((2, 3, 40), np.float16)
    assert native_repack.repack_q8_transposed(raw, out, scale_out)
    blocks = raw.view(block_dtype("<"))
    np.testing.assert_array_equal(out, np.swapaxes(blocks["qs"].reshape(2, 40, 96), -1, -2))
    np.testing.assert_array_equal(scale_out, np.swapaxes(blocks["d"].reshape(2, 40, 3), -1, -2))
  finally:
    monkeypatch.undo()
    native_lib.reset()
