"""The native library's dequantize and requantize-to-Q8_0 of GGUF's other tensor types
(`q8rules.checkpoint.gguf.requant_native`, `kernels/cpu/requant.h`) against gguf-py, bit for
bit: `gguf.quants.dequantize` and `gguf.quants.quantize(dequantize(...), Q8_0)`, on random
blocks of every type, ties, zero and non-finite blocks, and the real files' blocks (read with
`gguf.GGUFReader`; `python scripts/fetch_real_models.py` fetches them, and the tests that need
them skip without them unless `Q8RULES_REQUIRE_MODELS=1`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from q8rules.checkpoint.gguf import requant_native as rn
from q8rules.checkpoint.gguf.header import open_file
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import repack as native_repack
from q8rules.kernels.native import threads as native_threads

pytestmark = pytest.mark.skipif(
  not native_lib.available(),
  reason=f"native library unavailable: {native_lib.unavailable_reason()}",
)

SCALE_FIELDS = {
  T.Q4_0: (0,),
  T.Q4_1: (0, 2),
  T.Q5_0: (0,),
  T.Q5_1: (0, 2),
  T.Q8_0: (0,),
  T.Q2_K: (80, 82),
  T.Q3_K: (108,),
  T.Q4_K: (0, 2),
  T.Q5_K: (0, 2),
  T.Q6_K: (208,),
  T.MXFP4: (),
}
"""Byte offsets of each quantized type's float16 fields (d, and dmin or m) in its block
(MXFP4 has none: its scale is one E8M0 byte, `E8M0_AT`)."""

E8M0_AT = {T.MXFP4: 0}
"""Byte offset of a type's E8M0 scale (2^(e - 128), e in 0..255) in its block."""

FLOATS = (T.F32, T.F16, T.BF16)
NATIVE = (*FLOATS, *SCALE_FIELDS)

REAL_FILES = {
  "SmolLM2-135M-Instruct.Q4_1.gguf": (T.Q4_1, T.Q8_0),
  "gemma-3-270m-q4_k_m.gguf": (T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0),
}
"""The real files (scripts/fetch_real_models.py) and the quantized types each holds."""


def random_halves(rng: np.random.Generator, n: int) -> np.ndarray:
  """n finite float16 of both signs over the whole range: zeros, subnormals, up to 65504."""
  exponent = rng.uniform(-26, 15.9, n)
  h = (rng.choice([-1.0, 1.0], n) * 2.0**exponent).astype(np.float16)
  h[rng.random(n) < 0.05] = 0
  return h


def random_blocks(rng: np.random.Generator, qtype: T, n_rows: int, n_cols: int) -> np.ndarray:
  """(n_rows, bytes a row) uint8 of valid random blocks of `qtype`: random bytes with the
  float16 fields finite; for the float types, finite values of every magnitude."""
  values, nbytes = GGML_QUANT_SIZES[qtype]
  if qtype == T.F32:
    scale = 10.0 ** rng.uniform(-42, 36, (n_rows, n_cols // 32, 1))
    x = (rng.standard_normal((n_rows, n_cols // 32, 32)) * scale).astype(np.float32)
    return x.reshape(n_rows, -1).view(np.uint8)
  if qtype in (T.F16, T.BF16):
    bits = rng.integers(0, 1 << 16, (n_rows, n_cols), dtype=np.uint16)
    inf = 0x7C00 if qtype == T.F16 else 0x7F80
    bits[(bits & inf) == inf] &= ~np.uint16(0x4000)  # exponent all ones -> finite
    return bits.view(np.uint8)
  raw = rng.integers(0, 256, (n_rows, n_cols // values * nbytes), dtype=np.uint8)
  blocks = raw.reshape(-1, nbytes)
  for at in SCALE_FIELDS[qtype]:
    blocks[:, at : at + 2] = random_halves(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
  if qtype in E8M0_AT:  # subnormal scales (e < 2) and those of real weights (about 2^-20..2^8)
    e = rng.choice(np.r_[0:3, 108:137], len(blocks)).astype(np.uint8)
    blocks[:, E8M0_AT[qtype]] = e
  return raw


def gguf_requant(data: np.ndarray, qtype: T) -> np.ndarray:
  """gguf-py's requantize: its dequantize, then its Q8_0 quantizer (its warnings on
  non-finite values silenced)."""
  with warnings.catch_warnings(), np.errstate(all="ignore"):
    warnings.simplefilter("ignore", RuntimeWarning)
    return gguf.quants.quantize(gguf.quants.dequantize(data, qtype), T.Q8_0)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
  """got and want hold the same bytes (float32 compared as bits: -0.0 and NaNs included)."""
  assert got.shape == want.shape and got.dtype == want.dtype
  diff = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
  assert diff.size == 0, f"{diff.size} bytes differ, first at byte {diff[:5]}"


def check(data: np.ndarray, qtype: T, n_rows: int, n_cols: int, threads: int = 1) -> None:
  """Both native functions on `data` against gguf-py, bit for bit."""
  with np.errstate(all="ignore"):
    want = gguf.quants.dequantize(data, qtype).reshape(n_rows, n_cols)
  got = rn.dequantize_native(data, int(qtype), (n_rows, n_cols), threads=threads)
  assert_same_bits(got, want)
  q8 = rn.requantize_q8_0_native(data, int(qtype), n_rows, n_cols, threads=threads)
  assert_same_bits(q8, gguf_requant(data, qtype).reshape(n_rows, -1))


def test_native_types():
  assert rn.requant_native_types() == frozenset(int(t) for t in NATIVE)


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_random_blocks(rng, qtype, cpu_isa):
  check(random_blocks(rng, qtype, 4, 512), qtype, 4, 512)


@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q5_1, T.Q6_K, T.F16), ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunks_and_threads(rng, qtype, threads):
  """Rows that do not fill the last 4096-value chunk, nor the last run of 8 chunks that a
  thread takes at a time: 23 x 4608 = 105984 values, 25 chunks and 3584 values, 4 runs."""
  data = random_blocks(rng, qtype, 23, 4608)
  check(data, qtype, 23, 4608, threads)


def kernel_layout_of(blocks: np.ndarray, n_rows: int, n_cols: int) -> tuple[np.ndarray, ...]:
  """Q8_0 GGUF blocks ((n_rows, n_cols / 32 * 34) uint8) in the kernel layout, by numpy:
  (n_cols, n_rows) int8 values and (n_cols / 32, n_rows) float16 scales."""
  b = blocks.reshape(n_rows, n_cols // 32, 34)
  q = b[..., 2:].copy().view(np.int8).reshape(n_rows, n_cols).T
  return q, b[..., :2].copy().view(np.float16)[..., 0].T


@pytest.mark.parametrize("threads", [1, 2])
def test_requantized_straight_into_the_kernel_layout(rng, monkeypatch, cpu_isa, threads):
  """`repack_q8_transposed(..., source_types=...)`: tensors of every native type (and Q8_0
  among them, as a Q4_K_M stack mixes them), requantized in the same pass as they are
  transposed, into a column range of wider arrays: the bytes of gguf-py's requantize,
  transposed; nothing outside the range written. Rows past the last run of 64 and of 16."""
  monkeypatch.setattr(native_threads, "cpus", lambda: threads)
  monkeypatch.setattr(native_repack, "REPACK_THREAD_BYTES", 0)
  types = [*NATIVE, T.Q8_0]
  n_rows, n_cols, n0, wide = 83, 512, 7, 100
  datas = [random_blocks(rng, t, n_rows, n_cols) for t in types]
  q = np.zeros((len(types), n_cols, wide), np.int8)
  scale = np.zeros((len(types), n_cols // 32, wide), np.float16)
  cols = slice(n0, n0 + n_rows)
  parts = [np.ascontiguousarray(d).reshape(-1) for d in datas]
  assert native_repack.repack_q8_transposed(
    parts, q[:, :, cols], scale[:, :, cols], source_types=[int(t) for t in types]
  )
  for i, (qtype, data) in enumerate(zip(types, datas, strict=True)):
    blocks = data if qtype == T.Q8_0 else gguf_requant(data, qtype)
    want_q, want_scale = kernel_layout_of(blocks, n_rows, n_cols)
    assert_same_bits(q[i, :, cols], np.ascontiguousarray(want_q))
    assert_same_bits(scale[i, :, cols], np.ascontiguousarray(want_scale))
  assert not q[:, :, :n0].any() and not q[:, :, n0 + n_rows :].any()
  assert not scale[:, :, :n0].view(np.uint16).any()
  one_q, one_scale = np.zeros_like(q[:1]), np.zeros_like(scale[:1])  # one tensor: runs of rows
  assert native_repack.repack_q8_transposed(
    parts[4:5], one_q[:, :, cols], one_scale[:, :, cols], source_types=[int(types[4])]
  )
  assert_same_bits(one_q, q[4:5])
  assert_same_bits(one_scale, scale[4:5])
  with pytest.raises(ValueError, match="scale_out and one array a tensor"):
    native_repack.repack_q8_transposed(parts[0], q[:1, :, cols], source_types=int(types[0]))


@pytest.mark.parametrize("qtype", (T.F32, T.F16), ids=lambda t: t.name)
def test_ties_and_zero_blocks(qtype, cpu_isa):
  """Values exactly half a step between two int8 (d = 1: amax 127), both signs, round away
  from zero; all-zero blocks (+0 and -0) get d = 0 and q = 0."""
  ties = np.concatenate([np.arange(-15.5, 16, 1.0), [127.0]])  # -15.5 .. 15.5, then amax
  x = np.zeros((4, 64), np.float32)
  x[0, :32], x[0, 32:] = ties[1:], -ties[1:]
  x[1, :32], x[1, 32:] = ties[1:] / 4, 0.0
  x[2, 32:] = -0.0
  x[3] = np.linspace(-127.0, 127.0, 64)
  data = x.astype(np.float32 if qtype == T.F32 else np.float16).view(np.uint8)
  check(data, qtype, 4, 64)
  blocks = rn.requantize_q8_0_native(data, int(qtype), 4, 64).reshape(8, 34)
  assert blocks[0, 2:5].view(np.int8).tolist() == [-15, -14, -13]  # -14.5, -13.5, -12.5
  assert blocks[1, 2:5].view(np.int8).tolist() == [15, 14, 13]
  assert blocks[2, 2:5].view(np.int8).tolist() == [-15, -14, -13]  # d = 0.25: x * 4
  assert not blocks[3:6].any()  # the zero blocks (+0 and -0): d = 0, q = 0


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda t: t.name)
def test_non_finite(rng, qtype, cpu_isa):
  """NaN and infinite values (float types), float16 fields (quantized types) or MXFP4's
  largest E8M0 scale (2^127: its values overflow) do not crash it, and give gguf-py's bytes: a NaN scale where a block holds a NaN, an infinite one where
  it holds an infinity, and int8 0 for NaN products (what numpy's cast gives on x86)."""
  n_rows, n_cols = 4, 512
  data = random_blocks(rng, qtype, n_rows, n_cols)
  if qtype in FLOATS:
    special = {T.F32: (0x7FC00000, 0x7F800000, 0xFF800000), T.F16: (0x7E00, 0x7C00, 0xFC00)}
    special[T.BF16] = (0x7FC0, 0x7F80, 0xFF80)
    words = data.view(np.uint32 if qtype == T.F32 else np.uint16).reshape(-1)
    at = rng.choice(words.size, 12, replace=False)
    words[at] = np.resize(np.array(special[qtype], words.dtype), 12)
  elif qtype in E8M0_AT:  # e = 255: 2^127, times a code of 2 or more overflows to +-inf
    data.reshape(-1, GGML_QUANT_SIZES[qtype][1])[::3, E8M0_AT[qtype]] = 255
  else:
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    field = SCALE_FIELDS[qtype][0]
    bits = np.resize(np.array([0x7E00, 0x7C00, 0xFC00], np.uint16), len(blocks[::3]))
    blocks[::3, field : field + 2] = bits.view(np.uint8).reshape(-1, 2)  # NaN, inf, -inf
  with np.errstate(all="ignore"):
    values = gguf.quants.dequantize(data, qtype)
  assert np.isinf(values).any() and (qtype in E8M0_AT or np.isnan(values).any())
  check(data, qtype, n_rows, n_cols)


def test_errors_name_the_shapes(rng):
  q4k = random_blocks(rng, T.Q4_K, 2, 256)
  with pytest.raises(
    ValueError, match=r"\(4, 128\): rows of 128 values are not whole blocks of Q4_K \(256 values"
  ):
    rn.dequantize_native(q4k, int(T.Q4_K), (4, 128))
  with pytest.raises(
    ValueError, match=r"\(3, 256\): 3 rows of 256 values of Q4_K are 432 bytes, got 288"
  ):
    rn.requantize_q8_0_native(q4k, int(T.Q4_K), 3, 256)
  with pytest.raises(ValueError, match=r"rows of 48 values are not whole Q8_0 blocks"):
    rn.requantize_q8_0_native(np.zeros((2, 48), np.float16), int(T.F16), 2, 48)
  with pytest.raises(ValueError, match=r"out must be writable C-contiguous uint8 of 544 bytes"):
    rn.requantize_q8_0_native(q4k, int(T.Q4_K), 2, 256, out=np.empty(575, np.uint8))
  with pytest.raises(ValueError, match=r"shape \(\) has no rows"):
    rn.dequantize_native(q4k, int(T.Q4_K), ())
  with pytest.raises(ValueError, match=r">f2 data is big-endian"):
    rn.dequantize_native(np.zeros((2, 32), ">f2"), int(T.F16), (2, 32))
  out = np.empty((2, 272), np.uint8)
  assert rn.requantize_q8_0_native(q4k, int(T.Q4_K), 2, 256, out=out) is out


def test_not_native_is_none(monkeypatch):
  """A type the library does not read, or no library: None, and the caller uses gguf.quants."""
  for qtype in (T.IQ4_NL, T.TQ1_0, T.IQ4_XS, T.I8):
    assert int(qtype) not in rn.requant_native_types()
    assert rn.dequantize_native(np.zeros(64, np.uint8), int(qtype), (1, 256)) is None
    assert rn.requantize_q8_0_native(np.zeros(64, np.uint8), int(qtype), 1, 256) is None
  monkeypatch.setattr(native_lib, "library", lambda: None)
  assert rn.requant_native_types() == frozenset()
  assert rn.requantize_q8_0_native(np.zeros(34, np.uint8), int(T.Q8_0), 1, 32) is None


def model_file(name: str) -> Path:
  """A real file from scripts/fetch_real_models.py's cache ($Q8RULES_MODEL_DIR, else
  ~/.cache/q8rules/models); skips when it is missing, unless Q8RULES_REQUIRE_MODELS=1."""
  base = os.environ.get("Q8RULES_MODEL_DIR") or Path.home() / ".cache" / "q8rules" / "models"
  path = Path(base) / name
  if not path.exists():
    if os.environ.get("Q8RULES_REQUIRE_MODELS") == "1":
      pytest.fail(f"{path} is missing (python scripts/fetch_real_models.py)")
    pytest.skip(f"{path} is missing (python scripts/fetch_real_models.py)")
  return path


def real_tensors(name: str, reader: str) -> list[tuple[T, tuple[int, ...], np.ndarray]]:
  """(type, shape, bytes) of the file's tensors of the types requant reads (not its F32
  norms), read with gguf-py's GGUFReader (`reader='gguf'`, the reference; seconds for a large
  vocabulary) or q8rules' own header parser ('q8rules': a tenth of a second)."""
  path = model_file(name)
  if reader == "gguf":
    found = gguf.GGUFReader(path).tensors
    return [
      (t.tensor_type, tuple(int(n) for n in t.shape[::-1]), t.data)
      for t in found
      if t.tensor_type in SCALE_FIELDS
    ]
  found = open_file(path).tensors.values()
  return [(t.tensor_type, t.shape, t.data) for t in found if t.tensor_type in SCALE_FIELDS]


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_blocks(name):
  """Some rows (the first, middle and last 8) of the first tensor of each quantized type."""
  tensors = real_tensors(name, "q8rules")
  for qtype in REAL_FILES[name]:
    _, shape, data = next(t for t in tensors if t[0] == qtype)
    mid = len(data) // 2
    rows = np.concatenate([data[:8], data[mid : mid + 8], data[-8:]])
    check(rows, qtype, 24, shape[-1])


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("name", REAL_FILES)
def test_real_files_in_full(name):
  """Every quantized tensor of the file, whole, as GGUFReader reads it (gguf-py's side in
  pieces of 4096 rows)."""
  tensors = real_tensors(name, "gguf")
  assert {t[0] for t in tensors} == set(REAL_FILES[name])
  for qtype, shape, data in tensors:
    rows = np.asarray(data).reshape(-1, data.shape[-1])
    got = rn.requantize_q8_0_native(rows, int(qtype), len(rows), shape[-1])
    for r in range(0, len(rows), 4096):
      assert_same_bits(got[r : r + 4096], gguf_requant(rows[r : r + 4096], qtype))


def test_library_builds_without_warnings():
  """The library with requant.h in it is built with -Wall -Wextra and warns of nothing."""
  assert {"-Wall", "-Wextra"} <= set(native_lib.CXXFLAGS)
  assert hasattr(native_lib.library(), "Q8Requantize")
  log = native_lib.build_log()
  if log is None:
    pytest.skip("the loaded library was built before build logs were kept")
  assert "warning" not in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.heavy
def test_fma_build_gives_the_same_bits(tmp_path):
  """Built with FMA everywhere (`-march=native`), requant.h still rounds each float32 step on
  its own (no contraction): the same bytes as gguf-py, in a fresh process and build."""
  code = textwrap.dedent(
    """
    import numpy as np
    from tests import test_requant_native as t
    from q8rules.kernels.native import library as native_lib
    assert native_lib.available(), native_lib.unavailable_reason()
    assert "warning" not in native_lib.build_log()
    rng = np.random.default_rng(0)
    for qtype in t.NATIVE:
      t.check(t.random_blocks(rng, qtype, 8, 512), qtype, 8, 512)
    print("OK")
    """
  )
  env = dict(os.environ, CXX="c++ -march=native", Q8RULES_CACHE=str(tmp_path))
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
