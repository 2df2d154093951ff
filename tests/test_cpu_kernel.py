"""The native CPU Q8_0 kernel (XLA FFI, `q8rules.kernels.native`) against float64 references."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.kernels import CPU_MAX_ROWS, q8_matmul, resolve_product
from q8rules.kernels.matmul import cpu as matmul_cpu
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd
from q8rules.q8_0 import Q8Array
from tests._utils import close_to_float64, random_q8, random_x, rel_err, weight64

TOL = 1e-6

pytestmark = pytest.mark.skipif(
  not native_lib.available(),
  reason=f"native CPU kernel unavailable: {native_lib.unavailable_reason()}",
)


SHAPES = [
  # (m, K, N): N = 1, N not a multiple of 8 or 64, m across the 6-row tiles and 16-row groups
  (1, 32, 1),
  (3, 32, 7),
  (1, 96, 40),
  (8, 96, 1),
  (16, 64, 130),
  (17, 128, 72),
  (1, 256, 200),
  (64, 96, 33),
  (5, 1024, 1100),  # big enough to split the columns across threads
  (1, 2048, 2051),  # one wide row: q streamed whole rows at a time
  (1, 96, 4160),  # ... in two column stretches (4096 + 64)
  (1, 64, 250),  # ... and a narrow one
  (1, 96, 65600),  # a vocabulary-wide row: column stripes, the last one 64 columns
  (3, 64, 24640),  # ... three rows in stripes (register tiles)
]


@pytest.fixture(params=["avx2", "scalar"])
def path(request):
  """Run a test on the AVX2 path (where the CPU has it) and on the forced scalar path."""
  if request.param == "avx2" and not native_simd.has_avx2():
    pytest.skip("this CPU has no AVX2/FMA/F16C")
  native_simd.force_scalar(request.param == "scalar")
  yield request.param
  native_simd.force_scalar(False)


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_float64_reference(rng, path, m, k, n, scale_dtype):
  q, scale = random_q8(rng, k, n, scale_dtype)
  x = random_x(rng, (m, k))
  out = jax.jit(matmul_cpu.q8_matmul_cpu)(x, q, scale)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert close_to_float64(out, x, weight64(q, scale), TOL)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_x_matches_reference_of_rounded_x(rng, dtype):
  q, scale = random_q8(rng, 160, 72)
  x = random_x(rng, (3, 160), dtype)
  out = q8_matmul(x, Q8Array(q, scale, axis=0), implementation="cpu")
  assert out.dtype == dtype
  out32 = q8_matmul(
    x, Q8Array(q, scale, axis=0), implementation="cpu", preferred_element_type=jnp.float32
  )
  assert close_to_float64(out32, x.astype(jnp.float32), weight64(q, scale), TOL)


_THREADS_SCRIPT = """
import hashlib, sys
import jax, numpy as np
from q8rules.kernels.matmul import cpu as matmul_cpu
from q8rules.kernels.native import threads as native_threads
from tests._utils import random_q8, random_x
rng = np.random.default_rng(7)
f = jax.jit(matmul_cpu.q8_matmul_cpu)
for m, k, n in [(1, 2048, 520), (3, 1024, 1100), (40, 512, 1024), (1, 576, 576), (1, 1024, 4160),
                (1, 640, 65600), (4, 256, 20000)]:
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  out = np.asarray(f(x, q, scale))
  again = np.asarray(f(x, q, scale))
  assert out.tobytes() == again.tobytes(), (m, k, n)
  print(m, k, n, native_threads.last_threads(), hashlib.sha256(out.tobytes()).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.skipif(os.cpu_count() < 2 or not shutil.which("taskset"), reason="needs 2 CPUs")
def test_output_does_not_depend_on_the_threads():
  """A product split over threads (K cut into units fixed by the problem, each unit's sums
  added in unit order) is bit-equal to the same product on one CPU, and run to run."""

  def run(pin: list[str]) -> list[list[str]]:
    done = subprocess.run(
      [*pin, sys.executable, "-c", _THREADS_SCRIPT],
      capture_output=True,
      text=True,
      timeout=300,
      env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),
    )
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines()]

  one, many = run(["taskset", "-c", "0"]), run([])
  assert [r[4] for r in one] == [r[4] for r in many]  # the same bytes
  assert all(r[3] == "1" for r in one)
  assert any(int(r[3]) > 1 for r in many)  # these shapes do split over the CPUs


@pytest.mark.parametrize("m,k,n", [(1, 256, 65536 + 1000), (5, 96, 40000), (2, 640, 40000)])
def test_column_stripes_equal_the_units_over_all_columns(rng, m, k, n):
  """A product whose units' (M, N) buffers would be large runs as stripes of columns, each
  stripe summing the units of K in order: every column gets the sums it gets in a product that
  runs the units over all of its columns, here each 4096-column slice of q (the same K, so the
  same units) on its own; the same bytes."""
  if not native_simd.has_avx2():
    pytest.skip("this CPU has no AVX2/FMA/F16C")
  q, scale = random_q8(rng, k, n, np.float16)
  x = random_x(rng, (m, k))
  f = jax.jit(matmul_cpu.q8_matmul_cpu)
  whole = np.asarray(f(x, q, scale))
  for c in range(0, n, 4096):
    part = np.asarray(f(x, q[:, c : c + 4096], scale[:, c : c + 4096]))
    assert part.tobytes() == whole[:, c : c + 4096].tobytes(), c
  assert close_to_float64(whole, x, weight64(q, scale), TOL)


@pytest.mark.parametrize("n", [200, 576, 600, 2051, 4160])
def test_one_row_streamed_equals_the_register_tiles(rng, n):
  """One x row (against at least 64 columns) runs the row-streaming loop (q read a few whole
  rows at a time, prefetched ahead), two rows the register tiles; each column's sum is the same
  FMAs in the same order, so a row's output is the same bytes either way."""
  if not native_simd.has_avx2():
    pytest.skip("this CPU has no AVX2/FMA/F16C")
  q, scale = random_q8(rng, 96, n, np.float16)
  x = random_x(rng, (2, 96))
  f = jax.jit(matmul_cpu.q8_matmul_cpu)
  one, two = np.asarray(f(x[:1], q, scale)), np.asarray(f(x, q, scale))
  assert one.tobytes() == two[:1].tobytes()


def test_q8_matmul_cpu_equals_xla_path_on_a_quantized_weight(rng):
  w = q8rules.quantize(
    jnp.asarray(rng.standard_normal((256, 96)), jnp.float32), scale_dtype=jnp.float16
  )
  x = random_x(rng, (2, 5, 256))
  y_cpu = q8_matmul(x, w, implementation="cpu")
  y_xla = q8_matmul(x, w, implementation="xla")
  assert y_cpu.shape == (2, 5, 96)
  assert rel_err(y_cpu, y_xla) <= TOL


def test_vmap_over_x(rng):
  q, scale = random_q8(rng, 96, 40)
  x = random_x(rng, (4, 3, 96))
  out = jax.jit(jax.vmap(matmul_cpu.q8_matmul_cpu, in_axes=(0, None, None)))(x, q, scale)
  ref = np.einsum("bmk,kn->bmn", np.asarray(x, np.float64), weight64(q, scale))
  assert out.shape == (4, 3, 40)
  assert rel_err(out, ref) <= TOL
  # x batched along a later axis, nested vmap
  xt = jnp.transpose(x, (1, 0, 2))  # (3, 4, 96): vmap over axis 1, then over the rows
  inner = jax.vmap(lambda r: matmul_cpu.q8_matmul_cpu(r[None], q, scale)[0])
  out2 = jax.vmap(inner, in_axes=1)(xt)
  assert rel_err(out2, ref) <= TOL


def test_vmap_over_the_weight(rng):
  parts = [random_q8(rng, 64, 24) for _ in range(3)]
  q = jnp.stack([p[0] for p in parts])
  scale = jnp.stack([p[1] for p in parts])
  x = random_x(rng, (2, 64))
  out = jax.vmap(matmul_cpu.q8_matmul_cpu, in_axes=(None, 0, 0))(x, q, scale)
  ref = np.stack([np.asarray(x, np.float64) @ weight64(*p) for p in parts])
  assert rel_err(out, ref) <= TOL


def test_grad_wrt_x_is_dy_times_w_transposed(rng):
  q, scale = random_q8(rng, 128, 40)
  x = random_x(rng, (3, 128))
  dy = random_x(rng, (3, 40))

  def loss(x):
    return jnp.sum(matmul_cpu.q8_matmul_cpu(x, q, scale) * dy)

  dx = jax.jit(jax.grad(loss))(x)
  ref = np.asarray(dy, np.float64) @ weight64(q, scale).T
  assert dx.shape == x.shape
  assert rel_err(dx, ref) <= TOL
  # the primal of value_and_grad comes from the kernel
  value, _ = jax.value_and_grad(loss)(x)
  ref_value = np.sum((np.asarray(x, np.float64) @ weight64(q, scale)) * np.asarray(dy, np.float64))
  assert abs(float(value) - ref_value) <= 1e-5 * abs(ref_value) + 1e-5


def test_jvp_and_scale_gradient_match_xla_path(rng):
  from q8rules.kernels.matmul.xla_chunked import q8_matmul_xla

  q, scale = random_q8(rng, 96, 24)
  x = random_x(rng, (2, 96))
  dx = random_x(rng, (2, 96))
  y, t = jax.jvp(lambda x: matmul_cpu.q8_matmul_cpu(x, q, scale), (x,), (dx,))
  ref_t = np.asarray(dx, np.float64) @ weight64(q, scale)
  assert rel_err(t, ref_t) <= TOL
  g_cpu = jax.grad(lambda s: jnp.sum(matmul_cpu.q8_matmul_cpu(x, q, s) ** 2))(scale)
  g_xla = jax.grad(lambda s: jnp.sum(q8_matmul_xla(x, q, s) ** 2))(scale)
  assert rel_err(g_cpu, g_xla) <= 1e-5


def test_resolve_on_cpu():

  assert resolve_product(1, 4096, 4096, backend="cpu") == "cpu"
  assert resolve_product(CPU_MAX_ROWS, 4096, 4096, backend="cpu") == "cpu"
  assert resolve_product(CPU_MAX_ROWS + 1, 4096, 4096, backend="cpu") == "xla"
  assert resolve_product(64, 4096, 4096, backend="cpu") == "xla"
  # small weights (<= CPU_SMALL_WEIGHT values) take the kernel up to CPU_MAX_ROWS_SMALL rows
  small = matmul_cpu.CPU_SMALL_WEIGHT // 1536
  assert resolve_product(matmul_cpu.CPU_MAX_ROWS_SMALL, small, 1536, backend="cpu") == "cpu"
  assert resolve_product(matmul_cpu.CPU_MAX_ROWS_SMALL + 1, small, 1536, backend="cpu") == "xla"
  assert resolve_product(CPU_MAX_ROWS + 1, small + 32, 1536, backend="cpu") == "xla"
  assert (
    resolve_product(64, 4096, 4096, backend="cpu", implementation="cpu") == "cpu"
  )  # forced: any m
  if jax.default_backend() == "cpu":
    assert resolve_product(2, 4096, 4096) == "cpu"


def test_rule_accepts_cpu(rng):
  provider = q8rules.Q8Provider([q8rules.Q8Rule(implementation="cpu")])
  assert provider is not None


def test_compile_cache_is_reused():
  """The library the kernel was loaded from exists, and a fresh process loads it without
  compiling (CXX points at no compiler there, so compiling would make it unavailable)."""
  path = native_lib.loaded_path()
  assert path is not None and path.exists() and path == native_lib.library_path()
  code = (
    "from q8rules.kernels.native import library as c; print(c.available(), c.unavailable_reason())"
  )
  # The same $CXX (part of the cache key) but no PATH to find it on: a rebuild would fail.
  env = dict(os.environ, CXX=os.environ.get("CXX") or "c++", PATH="/nonexistent")
  done = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.split()[0] == "True", done.stdout


@pytest.mark.slow
def test_unavailable_without_compiler_falls_back_to_xla(tmp_path):
  code = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import q8rules
    from q8rules.kernels import q8_matmul, resolve_product
    from q8rules.kernels.native import library as native_lib
    assert not native_lib.available()
    print("REASON", native_lib.unavailable_reason())
    assert resolve_product(1, 64, 8, backend="cpu") == "xla"
    rng = np.random.default_rng(0)
    w = q8rules.quantize(jnp.asarray(rng.standard_normal((64, 8)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    y = q8_matmul(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(q8rules.dequantize(w), np.float64)
    assert np.linalg.norm(np.asarray(y) - ref) <= 1e-6 * np.linalg.norm(ref)
    try:
      q8_matmul(x, w, implementation="cpu")
    except ValueError as e:
      print("ERROR", e)
    """
  )
  env = dict(os.environ, CXX="/nonexistent/c++", Q8RULES_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
  done = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr
  assert "REASON no C++ compiler" in done.stdout
  assert "ERROR implementation='cpu'" in done.stdout
  assert not list(tmp_path.glob("*.so"))


def test_native_library_builds_without_warnings():
  """The library is compiled with -Wall -Wextra, and its sources give no warning."""
  if not native_lib.available():
    pytest.skip(f"native library unavailable: {native_lib.unavailable_reason()}")
  assert "-Wall" in native_lib.CXXFLAGS and "-Wextra" in native_lib.CXXFLAGS
  log = native_lib.build_log()
  if log is None:
    pytest.skip("the loaded library was built before build logs were kept")
  assert "warning" not in log, log[-3000:]
