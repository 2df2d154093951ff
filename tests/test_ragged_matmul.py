"""Op 'ragged_matmul', the grouped Q8_0 product `out[m] = x[m] @ W[g(m)]`: every implementation
against float64 on fresh random data (empty groups, one row, rows in no tile's multiple, K
padded to whole blocks, bf16 x), its gradient, its errors, its dispatch and the Pallas
kernels' TPU and CUDA lowerings."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from q8rules.kernels.matmul._pallas_compat import MOSAIC_CUSTOM_CALL, TRITON_CUSTOM_CALL
from q8rules.kernels.native.library import available, unavailable_reason
from q8rules.kernels.ragged_matmul import api
from q8rules.kernels.ragged_matmul.api import q8_ragged_matmul, resolve_ragged
from q8rules.kernels.ragged_matmul.groups import work_items
from q8rules.kernels.ragged_matmul.pallas import ragged_pallas
from q8rules.q8_0 import BLOCK, Q8Array
from tests._utils import lowering_for, rel_err
from tests.test_fold_lowering import custom_calls, mosaic_text, target, triton_config

# (group sizes, K, N): one row among empty groups; empty groups first, between and last; rows
# that span several row tiles of every form and are a multiple of none; K of 40 (padded to 64).
CASES = [
  ((0, 1, 0), 64, 40),
  ((0, 3, 0, 8, 0), 96, 72),
  ((5, 0, 0, 19, 13), 40, 130),
]


def experts(rng, e: int, k_pad: int, n: int, scale_dtype=np.float32) -> Q8Array:
  """E random Q8_0 experts: q int8 (E, K_pad, N) in [-127, 127], scales (E, K_pad/32, N) > 0."""
  q = rng.integers(-127, 128, size=(e, k_pad, n)).astype(np.int8)
  scale = rng.uniform(0.5, 2.0, size=(e, k_pad // BLOCK, n)) * 10.0 ** rng.uniform(-3, 0, (e, 1, 1))
  return Q8Array(jnp.asarray(q), jnp.asarray(scale.astype(scale_dtype)), axis=1)


def reference64(x, w: Q8Array, group_sizes) -> np.ndarray:
  """out[m] = x[m] @ W[g(m)] in float64, x zero-padded to the weight's K."""
  q = np.asarray(w.q, np.float64)
  w64 = q * np.repeat(np.asarray(w.scale, np.float64), BLOCK, axis=1)
  x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  x64 = np.pad(x64, ((0, 0), (0, w64.shape[1] - x64.shape[1])))
  g = np.repeat(np.arange(len(group_sizes)), group_sizes)
  return np.einsum("mk,mkn->mn", x64, w64[g])


def random_x(rng, m: int, k: int, dtype=jnp.float32) -> jax.Array:
  return jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)


def skip_unless_runs(name: str) -> None:
  if name == "cpu" and not available():
    pytest.skip(f"the native CPU kernel is unavailable: {unavailable_reason()}")


# Every implementation; the Pallas kernels' two forms in interpret mode.
RUNNERS = {
  "reference": lambda x, w, gs: q8_ragged_matmul(x, w, gs, implementation="reference"),
  "xla": lambda x, w, gs: q8_ragged_matmul(x, w, gs, implementation="xla"),
  "cpu": lambda x, w, gs: q8_ragged_matmul(x, w, gs, implementation="cpu"),
  "pallas_tpu": lambda x, w, gs: q8_ragged_matmul(x, w, gs, implementation="pallas"),
  "pallas_gpu": lambda x, w, gs: ragged_pallas(
    jnp.pad(x, ((0, 0), (0, w.shape[1] - x.shape[1]))), w.q, w.scale, gs, form="gpu",
    interpret=True,
  ).astype(x.dtype),
}  # fmt: skip


@pytest.mark.parametrize("name", RUNNERS)
@pytest.mark.parametrize("sizes,k,n", CASES)
def test_matches_float64(rng, name, sizes, k, n):
  """float32 x: within 1e-5 of float64, relative."""
  skip_unless_runs(name)
  e, m = len(sizes), sum(sizes)
  w = experts(rng, e, -(-k // BLOCK) * BLOCK, n)
  x = random_x(rng, m, k)
  gs = jnp.asarray(sizes, jnp.int32)
  y = jax.jit(RUNNERS[name])(x, w, gs)
  assert y.shape == (m, n) and y.dtype == jnp.float32
  assert rel_err(y, reference64(x, w, sizes)) <= 1e-5


@pytest.mark.parametrize("name", RUNNERS)
def test_bf16_x_and_float16_scales(rng, name):
  skip_unless_runs(name)
  sizes, k, n = (4, 0, 7), 64, 48
  w = experts(rng, 3, k, n, np.float16)
  x = random_x(rng, sum(sizes), k, jnp.bfloat16)
  y = RUNNERS[name](x, w, jnp.asarray(sizes, jnp.int32))
  assert y.dtype == jnp.bfloat16
  # bf16 x is exact in float32; the output's rounding to bf16 is the bound
  assert rel_err(y, reference64(x, w, sizes)) <= 4e-3


@pytest.mark.parametrize("name", ["reference", "xla", "pallas", "cpu"])
def test_gradient_matches_float64(rng, name):
  """d/dx and d/dscale of <out, c> against float64: dx[m] = c[m] @ W[g(m)]^T, dscale[e, b, n] =
  sum over e's rows of c[m, n] * sum_i x[m, 32b + i] q[e, 32b + i, n]."""
  skip_unless_runs(name)
  sizes, k, n = (3, 0, 6, 2), 64, 24
  e, m = len(sizes), sum(sizes)
  w = experts(rng, e, k, n)
  x = random_x(rng, m, k)
  c = rng.standard_normal((m, n))
  gs = jnp.asarray(sizes, jnp.int32)

  def loss(x, s):
    y = q8_ragged_matmul(x, Q8Array(w.q, s, axis=1), gs, implementation=name)
    return jnp.sum(y * c)

  dx, ds = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w.scale)
  g = np.repeat(np.arange(e), sizes)
  q64 = np.asarray(w.q, np.float64)
  w64 = q64 * np.repeat(np.asarray(w.scale, np.float64), BLOCK, axis=1)
  assert rel_err(dx, np.einsum("mn,mkn->mk", c, w64[g])) <= 1e-5
  x64 = np.asarray(x, np.float64).reshape(m, k // BLOCK, BLOCK)
  ref_ds = np.zeros((e, k // BLOCK, n))
  np.add.at(
    ref_ds, g, np.einsum("mbi,mbin,mn->mbn", x64, q64[g].reshape(m, k // BLOCK, BLOCK, n), c)
  )
  assert rel_err(ds, ref_ds) <= 1e-5


def test_traced_group_sizes_and_vmap(rng):
  """Group sizes known only at run time (one compiled program for every routing), and a vmap
  over a batch of rows."""
  w = experts(rng, 4, 64, 16)
  x = random_x(rng, 2 * 9, 64).reshape(2, 9, 64)
  f = jax.jit(lambda x, gs: q8_ragged_matmul(x, w, gs, implementation="xla"))
  for sizes in ((9, 0, 0, 0), (0, 2, 3, 4)):
    y = f(x[0], jnp.asarray(sizes, jnp.int32))
    assert rel_err(y, reference64(x[0], w, sizes)) <= 1e-5
  sizes = (1, 0, 8, 0)
  ys = jax.vmap(lambda x: q8_ragged_matmul(x, w, jnp.asarray(sizes, jnp.int32)))(x)
  for b in range(2):
    assert rel_err(ys[b], reference64(x[b], w, sizes)) <= 1e-5


def test_work_items_cover_each_rows_group_once():
  """Rows 0-20 in tiles of 8, groups (5, 0, 0, 9, 7): group 0 in tile 0, group 3 in tiles 0 and
  1, group 4 in tiles 1 and 2; the empty groups have no item."""
  items = work_items(jnp.asarray([5, 0, 0, 9, 7], jnp.int32), 21, 8)
  count = int(items.count)
  assert count == 5 and items.group.shape == (7,)  # 3 tiles + 5 groups - 1
  assert np.asarray(items.group)[:count].tolist() == [0, 3, 3, 4, 4]
  assert np.asarray(items.tile)[:count].tolist() == [0, 0, 1, 1, 2]
  assert np.asarray(items.first)[:count].tolist() == [1, 0, 1, 0, 1]


@pytest.mark.parametrize(
  "x_shape,w_shape,sizes,match",
  [
    ((10, 64), (3, 64, 8), (3, 3, 3), "group_sizes sum to 9, but x has M=10 rows"),
    ((6, 64), (3, 64, 8), (3, -1, 4), "negative sizes"),
    ((6, 64), (3, 64, 8), (3, 3), r"group_sizes of shape \(2,\) for 3 experts"),
    ((6, 96), (3, 64, 8), (3, 3, 0), "activations of K=96 do not contract with experts of K=64"),
    ((6, 16), (3, 64, 8), (3, 3, 0), "activations of K=16 do not contract"),
    ((2, 3, 64), (3, 64, 8), (3, 3, 0), r"activations must be 2-D \(M, K\)"),
  ],
)
def test_bad_input_names_what_is_wrong(rng, x_shape, w_shape, sizes, match):
  w = experts(rng, *w_shape)
  x = jnp.zeros(x_shape, jnp.float32)
  with pytest.raises(ValueError, match=match):
    q8_ragged_matmul(x, w, jnp.asarray(sizes, jnp.int32))


def test_bad_weight_and_dtypes(rng):
  w = experts(rng, 2, 64, 8)
  x = jnp.ones((4, 64), jnp.float32)
  gs = jnp.asarray([2, 2], jnp.int32)
  with pytest.raises(ValueError, match=r"3-D \(E, K, N\) blocked along axis 1"):
    q8_ragged_matmul(x, Q8Array(w.q[0], w.scale[0]), gs)
  with pytest.raises(TypeError, match="must be a Q8Array"):
    q8_ragged_matmul(x, w.q, gs)
  with pytest.raises(TypeError, match="group_sizes must be an integer array"):
    q8_ragged_matmul(x, w, jnp.asarray([2.0, 2.0]))
  with pytest.raises(TypeError, match="activations must be float32, bfloat16 or float16"):
    q8_ragged_matmul(x.astype(jnp.int32), w, gs)
  with pytest.raises(ValueError, match="implementation='fold'"):
    q8_ragged_matmul(x, w, gs, implementation="fold")


def test_default_order_per_platform():
  assert resolve_ragged(8, 2048, 768, 128, jnp.bfloat16, "tpu") == "pallas"
  assert resolve_ragged(8, 2048, 768, 128, jnp.bfloat16, "gpu") == "pallas"
  assert resolve_ragged(8, 2048, 768, 128, jnp.bfloat16, "cpu") == ("cpu" if available() else "xla")
  assert api.DEFAULT_ORDER["cpu"] == ("cpu", "xla")
  assert resolve_ragged(4096, 2048, 768, 128, jnp.float32, "cpu") == "xla"


# ---- lowering for TPU and CUDA from this host -------------------------------------------


def _specs(m, k, n, e, dtype):
  return (
    jax.ShapeDtypeStruct((m, k), dtype),
    jax.ShapeDtypeStruct((e, k, n), jnp.int8),
    jax.ShapeDtypeStruct((e, k // BLOCK, n), jnp.float16),
    jax.ShapeDtypeStruct((e,), jnp.int32),
  )


def _lowered(platform: str, specs):
  def f(x, q, s, gs):
    return q8_ragged_matmul(x, Q8Array(q, s, axis=1), gs, implementation="pallas", interpret=False)

  with lowering_for((platform,)):
    lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=(platform,))
  return lowered.compiler_ir("stablehlo")


def test_tpu_lowering_prefetches_the_items():
  """One Mosaic call for a Qwen3-30B-A3B-shaped decode step (8 rows, 128 experts, K 2048, N
  768): a grid of 3 column tiles of 256 by 128 work items, the items' six arrays
  scalar-prefetched."""
  (call,) = custom_calls(_lowered("tpu", _specs(8, 2048, 768, 128, jnp.bfloat16)))
  assert target(call) == MOSAIC_CUSTOM_CALL
  kernel = mosaic_text(call)
  assert "func.func @q8_ragged_tpu" in kernel
  assert "iteration_bounds = array<i64: 3, 128>" in kernel
  assert "scalar_prefetch = 6" in kernel
  assert "window_bounds = array<i64: 1, 2048, 256>" in kernel  # one expert's int8 tile
  assert "window_bounds = array<i64: 1, 64, 256>" in kernel  # its scales


def test_cuda_lowering_is_one_triton_call():
  (call,) = custom_calls(_lowered("cuda", _specs(8, 2048, 768, 128, jnp.bfloat16)))
  assert target(call) == TRITON_CUSTOM_CALL
  attrs, kernel = triton_config(call)
  assert attrs["name"] == '"q8_ragged_gpu"'
  assert attrs["grid_x"].startswith("12") and attrs["grid_y"].startswith("1 ")  # 768 / 64, 1 tile
  assert kernel.count("scf.for") == 2  # the tile's items, and each item's Q8_0 blocks
  assert re.findall(r"tt\.dot .*tensor<16x32xbf16>.*tensor<32x64xbf16>", kernel)


def test_export_carries_each_platforms_kernel(rng):
  """One `jax.export` for ('cpu', 'cuda', 'tpu'): each platform's module lowers only its own
  kernel; the artifact runs here with the CPU's."""
  from q8rules.kernels import export_checks

  sizes, k, n = (2, 0, 3), 64, 128
  w = experts(rng, 3, k, n)
  x = random_x(rng, 5, k)
  gs = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda x, q, s, gs: q8_ragged_matmul(x, Q8Array(q, s, axis=1), gs))
  platforms = ("cpu", "cuda", "tpu")
  with lowering_for(platforms):
    exp = export.export(f, platforms=platforms, disabled_checks=export_checks())(
      x, w.q, w.scale, gs
    )
  text = exp.mlir_module()
  assert MOSAIC_CUSTOM_CALL in text and TRITON_CUSTOM_CALL in text
  if jax.default_backend() == "cpu":
    assert rel_err(exp.call(x, w.q, w.scale, gs), reference64(x, w, sizes)) <= 1e-5


@pytest.mark.parametrize("name", RUNNERS)
def test_experts_without_rows_are_never_read(rng, name):
  """Experts that get no rows hold NaN scales: the output is still every routed row's product."""
  skip_unless_runs(name)
  sizes, k, n = (0, 6, 0, 3, 0), 64, 40
  w = experts(rng, len(sizes), k, n)
  nan = jnp.asarray([s == 0 for s in sizes])[:, None, None]
  w = Q8Array(w.q, jnp.where(nan, jnp.nan, w.scale), axis=1)
  x = random_x(rng, sum(sizes), k)
  y = RUNNERS[name](x, w, jnp.asarray(sizes, jnp.int32))
  assert rel_err(y, reference64(x, w, sizes)) <= 1e-5


def test_cpu_kernel_paths_match_float64(rng, cpu_isa):
  """Each SIMD path of the native kernel this CPU runs (`cpu_isa` sets $Q8RULES_CPU_ISA, read
  on every call), with an expert of more than 16 rows (two passes of its rows over its
  weight)."""
  skip_unless_runs("cpu")
  sizes, k, n = (2, 0, 19, 1), 96, 72
  w = experts(rng, len(sizes), k, n, np.float16)
  x = random_x(rng, sum(sizes), k)
  y = q8_ragged_matmul(x, w, jnp.asarray(sizes, jnp.int32), implementation="cpu")
  assert rel_err(y, reference64(x, w, sizes)) <= 1e-5


def test_cpu_kernel_refuses_group_sizes_past_the_rows(rng):
  """Traced group sizes are checked by the kernel: summing past M fails the call."""
  skip_unless_runs("cpu")
  w = experts(rng, 2, 32, 8)
  f = jax.jit(lambda x, gs: q8_ragged_matmul(x, w, gs, implementation="cpu"))
  with pytest.raises(Exception, match="group 1 has 5 rows, past the 4 rows of x"):
    f(jnp.ones((4, 32)), jnp.asarray([2, 5], jnp.int32)).block_until_ready()


def test_cpu_kernel_is_each_experts_product_bit_for_bit(rng):
  """The native grouped product gives each expert's rows the native weight-only product's bits
  (the same units of K, added in the same order), on one thread and on two."""
  import q8rules
  from q8rules.kernels import q8_matmul

  skip_unless_runs("cpu")
  sizes, k, n = (1, 0, 3, 2), 2048, 96  # K long enough to be cut into units
  w = experts(rng, len(sizes), k, n, np.float16)
  x = random_x(rng, sum(sizes), k)
  gs = jnp.asarray(sizes, jnp.int32)
  bounds = np.cumsum((0, *sizes))
  each = [
    q8_matmul(x[a:b], Q8Array(w.q[e], w.scale[e]), implementation="cpu")
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    if b > a
  ]
  try:
    for threads in (1, 2):
      q8rules.set_cpu_threads(threads)
      y = q8_ragged_matmul(x, w, gs, implementation="cpu")
      np.testing.assert_array_equal(np.asarray(y), np.concatenate(each))
  finally:
    q8rules.set_cpu_threads(None)
