"""The fold kernels in interpret mode against a float64 reference; when the fold applies."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.kernels import q8_matmul, resolve_product
from q8rules.kernels.matmul import fold
from q8rules.kernels.matmul.fold import TILE_ROWS, fold_applies, kernel_form, q8_fold
from q8rules.kernels.matmul.pallas_mosaic_tpu import block_k, column_tile, fold_tpu
from q8rules.kernels.matmul.pallas_triton import blocks_per_step, fold_gpu, k_splits
from q8rules.kernels.matmul.reference import q8_matmul_reference
from q8rules.kernels.matmul.xla_chunked import q8_matmul_xla
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.problem import Problem
from q8rules.q8_0 import BLOCK, Q8Array
from tests._utils import rel_err

# m, K and N each take all three of their values (a Latin square): 9 compiles, not 27.
TPU_CASES = [
  (1, 1024, 128),
  (3, 2048, 40),
  (8, 3072, 384),
  (8, 1024, 40),
  (1, 2048, 384),
  (3, 3072, 128),
  (3, 1024, 384),
  (8, 2048, 128),
  (1, 3072, 40),
]
GPU_CASES = [(1, 1024, 40), (16, 2048, 128), (7, 3072, 200)]


def problem(m: int, k: int, n: int, backend: str) -> Problem:
  """The problem of an (m, K) x (K, N) product with bf16 activations on `backend`."""
  return Problem.of(m, k, n, jnp.bfloat16, backend)


def operands(rng: np.random.Generator, m: int, k: int, n: int, scale_dtype=np.float32):
  """Fresh x (m, K) f32 normal, q (K, N) int8 over all of [-127, 127], scale (K/32, N) > 0."""
  x = rng.standard_normal((m, k)).astype(np.float32)
  q = rng.integers(-127, 128, (k, n)).astype(np.int8)
  scale = (rng.uniform(0.5, 2.0, (k // BLOCK, n)) * 10.0 ** rng.uniform(-4, -1)).astype(scale_dtype)
  return x, q, scale


def reference64(x, q, scale) -> np.ndarray:
  """x @ (q * scale) in float64 from the values as stored (x after any bf16 rounding)."""
  w = q.astype(np.float64) * np.repeat(np.asarray(scale, np.float64), BLOCK, axis=0)
  return np.asarray(x, np.float64) @ w


def bf16_rounded(x: np.ndarray) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("m,k,n", TPU_CASES)
def test_tpu_form_f32(rng, m, k, n):
  x, q, scale = operands(rng, m, k, n)
  out = q8_fold(x, q, scale, backend="tpu")
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert rel_err(out, reference64(x, q, scale)) <= 1e-6


@pytest.mark.parametrize("m,k,n", [TPU_CASES[0], TPU_CASES[1], TPU_CASES[2]])
def test_tpu_form_bf16(rng, m, k, n):
  x, q, scale = operands(rng, m, k, n)
  out = q8_fold(jnp.asarray(x, jnp.bfloat16), q, scale, backend="tpu")
  assert out.dtype == jnp.float32
  # Each int8 x bf16 product is exact in fp32: only the fp32 sums round.
  assert rel_err(out, reference64(bf16_rounded(x), q, scale)) <= 1e-6
  assert rel_err(out, reference64(x, q, scale)) <= 1e-2


def test_tpu_form_unrolled_matches(rng):
  """The block loop as Mosaic runs it (unrolled, static offsets), interpreted."""
  x, q, scale = operands(rng, 8, 2048, 256)
  unrolled = jax.jit(lambda x: fold_tpu(x, q, scale, interpret=True, unroll=True))(x)
  rolled = jax.jit(lambda x: fold_tpu(x, q, scale, interpret=True, unroll=False))(x)
  ref = reference64(x, q, scale)
  assert rel_err(unrolled, ref) <= 1e-6
  assert rel_err(rolled, ref) <= 1e-6


@pytest.mark.parametrize("m,k,n", GPU_CASES)
def test_gpu_form_f32(rng, m, k, n):
  x, q, scale = operands(rng, m, k, n)
  out = q8_fold(x, q, scale, backend="gpu")
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert rel_err(out, reference64(x, q, scale)) <= 1e-6


def test_gpu_form_bf16(rng):
  x, q, scale = operands(rng, 16, 1024, 40)
  out = q8_fold(jnp.asarray(x, jnp.bfloat16), q, scale, backend="gpu")
  assert rel_err(out, reference64(bf16_rounded(x), q, scale)) <= 1e-6
  assert rel_err(out, reference64(x, q, scale)) <= 1e-2


@pytest.mark.parametrize("splits,group", [(1, 4), (2, 1), (4, 2), (8, 4)])
def test_gpu_form_any_split_of_k(rng, splits, group):
  """The K slices' partials add up to the product, whatever the split and the loop step;
  m = 3 < 16 rows: the masked store leaves the pad rows out of the sum."""
  x, q, scale = operands(rng, 3, 1024, 64)
  out = fold_gpu(jnp.asarray(x), q, scale, splits=splits, group=group, interpret=True)
  assert out.shape == (3, 64)
  assert rel_err(out, reference64(x, q, scale)) <= 1e-6


def test_gpu_form_rejects_splits_that_cut_a_block(rng):
  x, q, scale = operands(rng, 1, 1056, 64)
  with pytest.raises(ValueError, match="K slices do not divide K=1056"):
    fold_gpu(x, q, scale, splits=2, interpret=True)
  with pytest.raises(ValueError, match="blocks a step do not divide"):
    fold_gpu(x, q, scale, splits=3, group=2, interpret=True)
  with pytest.raises(ValueError, match="splits= is for the GPU form"):
    q8_fold(x, q, scale, backend="tpu", splits=3)


def test_k_splits_fill_the_gpu():
  """The fewest K slices giving >= 2 programs per SM (132 SMs), at least 8 blocks a slice."""
  assert k_splits(4096, 4096, sms=132) == 8  # 64 tiles x 8 = 512 programs
  assert k_splits(14336, 4096, sms=132) == 7  # 448 blocks = 7 x 64
  assert k_splits(4096, 14336, sms=132) == 2  # 224 tiles
  assert k_splits(8192, 8192, sms=132) == 4
  assert k_splits(8192, 28672, sms=132) == 1  # 448 tiles fill it already
  assert k_splits(4096, 128256, sms=132) == 1
  assert k_splits(256, 64, sms=132) == 1  # 8 blocks: one slice
  assert k_splits(32 * 37, 64, sms=132) == 1  # 37 blocks, prime: no whole split of >= 8
  assert blocks_per_step(4096) == 4 and blocks_per_step(32 * 11) == 1 and blocks_per_step(96) == 3


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_k_not_a_multiple_of_1024(rng, backend):
  """K = 33 blocks: the TPU form takes K steps of 11 blocks, the GPU form 3 K slices of 11."""
  assert block_k(1056) == 352 and block_k(3072) == 1024 and block_k(32 * 37) == 32
  assert k_splits(1056, 72) == 3
  x, q, scale = operands(rng, 5, 1056, 72)
  out = q8_fold(x, q, scale, backend=backend)
  assert rel_err(out, reference64(x, q, scale)) <= 1e-6


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_float16_activations_and_scales(rng, backend):
  x, q, scale = operands(rng, 2, 1024, 128, scale_dtype=np.float16)
  x16 = x.astype(np.float16)
  out = q8_fold(jnp.asarray(x16), q, jnp.asarray(scale), backend=backend)
  assert rel_err(out, reference64(x16, q, scale)) <= 1e-6


def test_padding_columns_stay_in_the_pad(rng):
  """N=40 runs as one 128-column tile padded with zeros; its 40 columns are bit-equal to
  the first 40 of the same tile holding 88 more real columns: nothing crosses columns."""
  x, q, scale = operands(rng, 3, 1024, 128)
  narrow = q8_fold(x, q[:, :40], scale[:, :40], backend="tpu")
  wide = q8_fold(x, q, scale, backend="tpu")
  np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide)[:, :40])


def test_q8_matmul_fold_end_to_end(rng):
  """Through `q8_matmul` with a quantized Q8Array and batch dims: (2, 3, K) -> 6 rows."""
  w = rng.standard_normal((2048, 40)).astype(np.float32)
  wq = q8rules.quantize(w)
  x = rng.standard_normal((2, 3, 2048)).astype(np.float32)
  y = q8_matmul(x, wq, implementation="fold")
  assert y.shape == (2, 3, 40) and y.dtype == jnp.float32
  ref = reference64(x.reshape(6, 2048), np.asarray(wq.q), np.asarray(wq.scale))
  assert rel_err(np.asarray(y).reshape(6, 40), ref) <= 1e-6
  # What ran is the fold itself: the same bits as calling it directly.
  direct = q8_fold(jnp.asarray(x.reshape(6, 2048)), wq.q, wq.scale)
  np.testing.assert_array_equal(np.asarray(y).reshape(6, 40), np.asarray(direct))
  # By default the fold runs on TPU and GPU, never on CPU (interpret mode only there).
  default = resolve_product(6, 2048, 40, jnp.float32)
  if jax.default_backend() == "cpu":
    assert default == ("cpu" if native_lib.available() else "xla")


def test_q8_matmul_pallas_under_jit(rng):
  x, q, scale = operands(rng, 1, 1024, 128)
  w = Q8Array(q=jnp.asarray(q), scale=jnp.asarray(scale))
  y = jax.jit(lambda x, w: q8_matmul(x, w, implementation="fold"))(x, w)
  assert rel_err(y, reference64(x, q, scale)) <= 1e-6


# ---- gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_grad_matches_xla_path(rng, backend):
  x, q, scale = operands(rng, 3, 1024, 40)
  cot = rng.standard_normal((3, 40)).astype(np.float32)

  def loss_fold(x, scale):
    return jnp.sum(q8_fold(x, q, scale, backend=backend) * cot)

  def loss_xla(x, scale):
    return jnp.sum(q8_matmul_xla(x, q, scale) * cot)

  def loss_ref(x, scale):
    return jnp.sum(q8_matmul_reference(x, q, scale) * cot)

  dx, ds = jax.grad(loss_fold, argnums=(0, 1))(x, scale)
  dx_xla = jax.grad(loss_xla)(x, scale)
  ds_ref = jax.grad(loss_ref, argnums=1)(x, scale)
  assert dx.shape == x.shape and ds.shape == scale.shape
  assert rel_err(dx, dx_xla) <= 1e-6
  assert rel_err(ds, ds_ref) <= 1e-6


def test_grad_through_q8_matmul_bf16(rng):
  x, q, scale = operands(rng, 8, 1024, 128)
  w = Q8Array(q=jnp.asarray(q), scale=jnp.asarray(scale))
  xb = jnp.asarray(x, jnp.bfloat16)

  def loss(x, impl):
    return jnp.sum(q8_matmul(x, w, implementation=impl).astype(jnp.float32) ** 2)

  dx = jax.grad(loss)(xb, "fold")
  dx_xla = jax.grad(loss)(xb, "xla")
  assert dx.dtype == jnp.bfloat16
  assert rel_err(dx, dx_xla) <= 1e-2


# ---- when the fold applies ----------------------------------------------------------------


def test_applies_and_reasons():
  assert fold_applies(1, 4096, 4096, backend="tpu")
  assert fold_applies(8, 4096, 4096, backend="tpu")
  assert fold_applies(1, 4096, 40, backend="tpu")  # a chip's 24 of 48 heads, one padded tile
  assert fold_applies(16, 8192, 28672, backend="gpu")
  assert fold_applies(8, 1024, 128, backend="cpu")  # the TPU form, interpreted
  assert fold.cannot(problem(9, 4096, 4096, "tpu")) == "m=9 > 8 tile rows"
  assert fold.cannot(problem(64, 4096, 4096, "cpu")) == "m=64 > 8 tile rows"
  assert fold.cannot(problem(17, 4096, 4096, "gpu")) == "m=17 > 16 tile rows"
  assert fold.cannot(problem(16, 4096, 4096, "cuda")) is None
  assert fold.slower(problem(16, 4096, 4096, "cuda")) is None
  assert fold.cannot(problem(1, 1000, 4096, "tpu")) == "K=1000 not a multiple of 32"
  assert fold.cannot(problem(0, 1024, 128, "tpu")) is not None
  # On CPU the fold only interprets: it can run, and `implementation=None` passes it over.
  assert fold.cannot(problem(8, 1024, 128, "cpu")) is None
  assert "interpret" in fold.slower(problem(8, 1024, 128, "cpu"))
  # Too few columns: x re-read for 8 outputs costs more than a dense bf16 weight.
  assert not fold_applies(8, 1024, 8, backend="tpu")
  assert fold.cannot(problem(8, 1024, 8, "tpu")) is None
  assert "column tiles" in fold.slower(problem(8, 1024, 8, "tpu"))
  # float32 rows on GPU: 16 rows x 4 bytes over 64-column tiles re-read x too often.
  assert fold_applies(16, 4096, 4096, backend="gpu", itemsize=2)
  assert not fold_applies(16, 4096, 4096, backend="gpu", itemsize=4)
  with pytest.raises(ValueError, match="unknown backend"):
    fold_applies(1, 1024, 128, backend="metal")


def test_resolve():
  on_cpu = "cpu" if native_lib.available() else "xla"  # never the fold on CPU
  assert resolve_product(1, 4096, 4096, backend="cpu") == on_cpu
  assert resolve_product(64, 4096, 4096, backend="cpu") == "xla"
  assert resolve_product(1, 4096, 4096, backend="tpu") == "fold"
  assert resolve_product(8, 4096, 4096, backend="tpu") == "fold"
  assert (
    resolve_product(64, 4096, 4096, backend="tpu") == "xla_dequant"
  )  # many rows: dequantise, dot
  assert resolve_product(16, 4096, 4096, jnp.bfloat16, backend="gpu") == "fold"
  assert resolve_product(16, 4096, 4096, jnp.float32, backend="gpu") == "xla_dequant"
  assert resolve_product(2048, 4096, 14336, jnp.bfloat16, backend="gpu") == "xla_dequant"
  assert resolve_product(1, 1000, 4096, backend="gpu") == "xla_dequant"
  assert resolve_product(512, 4096, 4096, backend="cpu") == "xla"  # the CPU keeps its scan
  # A sequence is tried in order; a forced name must be able to run the product.
  assert resolve_product(64, 4096, 4096, backend="tpu", implementation=("fold", "xla")) == "xla"
  with pytest.raises(ValueError, match="'fold': m=64 > 8 tile rows"):
    resolve_product(64, 4096, 4096, backend="tpu", implementation="fold")
  with pytest.raises(ValueError, match="expected None, one of"):
    resolve_product(1, 4096, 4096, implementation="bogus")


def test_exported():
  assert q8rules.fold_applies is fold_applies
  assert q8rules.kernels.fold_applies is fold_applies


# ---- bad inputs --------------------------------------------------------------------------


def test_fold_rejects_too_many_rows(rng):
  x, q, scale = operands(rng, 64, 1024, 128)
  w = Q8Array(q=jnp.asarray(q), scale=jnp.asarray(scale))
  rows = TILE_ROWS[kernel_form()]  # this backend's form: TPU (and CPU, interpreted) 8, GPU 16
  with pytest.raises(ValueError, match=f"m=64 > {rows} tile rows"):
    q8_matmul(x, w, implementation="fold")
  with pytest.raises(ValueError, match="m=64 > 16 tile rows"):
    q8_fold(x, q, scale, backend="gpu")
  with pytest.raises(ValueError, match="m=9"):
    fold_tpu(x[:9], q, scale, interpret=True)
  with pytest.raises(ValueError, match="m=17"):
    fold_gpu(x[:17], q, scale, interpret=True)


def test_forced_fold_runs_past_the_bytes_rule(rng):
  """The bytes rule is advice on speed: `implementation=None` passes the fold over, a forced
  'fold' still runs it, correctly."""
  x, q, scale = operands(rng, 8, 1024, 8)
  w = Q8Array(q=jnp.asarray(q), scale=jnp.asarray(scale))
  assert "column tiles" in fold.slower(problem(8, 1024, 8, "tpu"))
  assert resolve_product(8, 1024, 8, backend="tpu") == "xla_dequant"
  y = q8_matmul(x, w, implementation="fold")
  assert rel_err(y, reference64(x, q, scale)) <= 1e-6


def test_rejects_k_not_whole_blocks(rng):
  x = rng.standard_normal((1, 1000)).astype(np.float32)
  q = rng.integers(-127, 128, (1000, 128)).astype(np.int8)
  scale = rng.uniform(0.01, 0.1, (31, 128)).astype(np.float32)
  with pytest.raises(ValueError, match="K=1000 not a multiple of 32"):
    q8_fold(x, q, scale, backend="tpu")
  with pytest.raises(ValueError, match="q8_matmul: K=1000 not a multiple of 32"):
    q8_matmul(x, Q8Array(q=jnp.asarray(q), scale=jnp.asarray(scale)), implementation="fold")


def test_rejects_bad_dtypes_and_shapes(rng):
  x, q, scale = operands(rng, 2, 1024, 128)
  with pytest.raises(TypeError, match="int8"):
    q8_fold(x, q.astype(np.float32), scale)
  with pytest.raises(TypeError, match="activations"):
    q8_fold(x.astype(np.int32), q, scale)
  with pytest.raises(TypeError, match="scales"):
    q8_fold(x, q, jnp.asarray(scale, jnp.bfloat16))
  with pytest.raises(ValueError, match="do not contract with a weight of K=1024"):
    q8_fold(rng.standard_normal((2, 2048)).astype(np.float32), q, scale)
  with pytest.raises(ValueError, match="scale shape"):
    q8_fold(x, q, scale[:, :64])
  with pytest.raises(ValueError, match=r"q8_fold: x must be \(m, K\), got shape \(1024,\)"):
    q8_fold(x[0], q, scale)
  with pytest.raises(ValueError, match="column tile"):
    fold_tpu(x, q[:, :40], scale[:, :40], interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    fold_gpu(x, q, scale, block_n=48, interpret=True)


def test_column_tiles():
  assert column_tile(40) == 128
  assert column_tile(128) == 128
  assert column_tile(384) == 128
  assert column_tile(4096) == 1024
  assert column_tile(28672) == 1024
  assert column_tile(1024) == 512  # two tiles for two TensorCores


@pytest.mark.slow
@pytest.mark.parametrize(
  "m,k,n", list(itertools.product((1, 3, 8), (1024, 2048, 3072), (128, 40, 384)))
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_form_all_shapes(rng, m, k, n, dtype):
  x, q, scale = operands(rng, m, k, n)
  out = q8_fold(jnp.asarray(x, dtype), q, scale, backend="tpu")
  xr = x if dtype == jnp.float32 else bf16_rounded(x)
  assert rel_err(out, reference64(xr, q, scale)) <= 1e-6
