"""Each SIMD path of the native CPU kernel (AVX-512, AVX2, scalar on x86-64; NEON with and
without sdot, scalar on aarch64) against float64 references.

The kernel reads `$Q8RULES_CPU_ISA` on every call, so each test forces its path (the `cpu_isa`
fixture of tests/conftest.py) and checks, through the library's `Q8GemvLastIsa`, that the call
ran it.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.kernels.matmul import cpu as matmul_cpu
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd
from tests._utils import close_to_float64, random_q8, random_x, rel_err, weight64

pytestmark = pytest.mark.skipif(
  not native_lib.available(),
  reason=f"native CPU kernel unavailable: {native_lib.unavailable_reason()}",
)

ISAS = native_simd.ISAS
"""The kernel's paths, in the order of its `Isa` codes (isa.h)."""

ENV = "Q8RULES_CPU_ISA"


def lib() -> ctypes.CDLL:
  """The loaded kernel library (dlopen of the same path shares its state)."""
  path = native_lib.loaded_path()
  assert path is not None
  handle = ctypes.CDLL(str(path))
  handle.Q8GemvIsaName.restype = ctypes.c_char_p
  return handle


def best_isa() -> str:
  return ISAS[lib().Q8GemvBestIsa()]


SHAPES = [
  # (m, K, N). N: 1, under 16, 64-column stretches plus a 16-column and a < 16 tail.
  # m: every AVX-512 tile height (1..6: one m x 64 tile, 7, 8: two m x 32, 9..16: float32
  # stretch and 8-row tiles), AVX2's (2, 3: m x 32; 4: m x 24; 5, 6: m x 16; 7..16: float32
  # stretch and balanced tiles of up to 4 rows) and past one 16-row group.
  (1, 32, 1),
  (1, 64, 149),
  (2, 96, 13),
  (3, 64, 149),
  (4, 96, 200),  # AVX2: 4 x 24, 4 x 24, 4 x 16 tiles
  (5, 128, 80),
  (6, 64, 64),
  (7, 96, 149),
  (8, 64, 128),
  (9, 64, 149),
  (10, 64, 149),  # AVX2: float tiles of 4, 3 and 3 rows
  (12, 128, 96),
  (16, 64, 149),
  (17, 96, 70),
  (1, 1024, 1100),  # big enough for several threads
  (8, 2048, 528),
]


@pytest.fixture
def isa(cpu_isa):
  """Each path this CPU runs, in turn (`cpu_isa`), checked to be the path the call ran."""
  yield cpu_isa
  assert lib().Q8GemvLastIsa() == ISAS.index(cpu_isa), "the call ran another path"


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_float64_reference(rng, isa, m, k, n, scale_dtype):
  q, scale = random_q8(rng, k, n, scale_dtype)
  x = random_x(rng, (m, k))
  out = jax.jit(matmul_cpu.q8_matmul_cpu)(x, q, scale)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert close_to_float64(out, x, weight64(q, scale), 1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_x(rng, isa, dtype):
  """x in bfloat16 / float16 is widened exactly: compare with float64 of the rounded x."""
  q, scale = random_q8(rng, 160, 80, np.float16)
  x = random_x(rng, (3, 160), dtype)
  out = matmul_cpu.q8_matmul_cpu(x, q, scale)
  assert close_to_float64(out, x.astype(jnp.float32), weight64(q, scale), 1e-6)


def test_simd_paths_agree_to_the_bit(rng, monkeypatch):
  """The SIMD paths do the same float32 operations in the same order (block partial sums by
  FMA, then y += d * s), only in wider or narrower vectors, so for N a multiple of 16 (no
  scalar tail) they agree to the bit."""
  simd = native_simd.supported()[1:]
  if len(simd) < 2:
    pytest.skip(f"needs two SIMD paths; this CPU runs {simd}")
  for m, k, n in [(1, 256, 192), (4, 96, 80), (8, 128, 64), (13, 64, 128)]:
    q, scale = random_q8(rng, k, n, np.float16)
    x = random_x(rng, (m, k))
    outs = {}
    for name in simd:
      monkeypatch.setenv(ENV, name)
      outs[name] = np.asarray(matmul_cpu.q8_matmul_cpu(x, q, scale))
      assert lib().Q8GemvLastIsa() == ISAS.index(name)
    for name, out in outs.items():
      np.testing.assert_array_equal(out, outs[simd[0]], err_msg=name)


def test_selection_follows_the_environment(monkeypatch):
  """Unset / empty / auto: the best path; a named path is capped at what the CPU has; the
  scalar switch of `native_simd.force_scalar` wins over the environment."""
  handle = lib()
  best = handle.Q8GemvBestIsa()
  assert handle.Q8GemvIsaName(best).decode() == ISAS[best]
  monkeypatch.delenv(ENV, raising=False)
  assert handle.Q8GemvSelectedIsa() == best
  for value in ("", "auto"):
    monkeypatch.setenv(ENV, value)
    assert handle.Q8GemvSelectedIsa() == best
  rungs = native_simd.ladder()
  for rung, name in enumerate(rungs):
    monkeypatch.setenv(ENV, name)
    capped = rungs[min(rung, rungs.index(ISAS[best]))]
    assert handle.Q8GemvSelectedIsa() == ISAS.index(capped)
  for name in set(ISAS) - set(rungs):  # another architecture's path is refused
    monkeypatch.setenv(ENV, name)
    assert handle.Q8GemvSelectedIsa() == -1
  monkeypatch.setenv(ENV, rungs[-1])
  native_simd.force_scalar(True)
  try:
    assert handle.Q8GemvSelectedIsa() == 0
    assert not native_simd.has_avx2()
  finally:
    native_simd.force_scalar(False)
  assert handle.Q8GemvSelectedIsa() == best


def test_unknown_isa_is_an_error(rng, monkeypatch):
  """A misspelt path is refused by the call, not replaced by another one."""
  q, scale = random_q8(rng, 64, 16)
  x = random_x(rng, (1, 64))
  monkeypatch.setenv(ENV, "avx-512")
  assert lib().Q8GemvSelectedIsa() == -1
  with pytest.raises(Exception, match=ENV):
    jax.block_until_ready(matmul_cpu.q8_matmul_cpu(x, q, scale))
  monkeypatch.setenv(ENV, "auto")
  out = matmul_cpu.q8_matmul_cpu(x, q, scale)
  assert rel_err(out, np.asarray(x, np.float64) @ weight64(q, scale)) <= 1e-6


def test_isa_names_the_path(isa, rng):
  """`native.simd.isa()` reports what the library chose and ran, by name."""
  q, scale = random_q8(rng, 64, 32)
  jax.block_until_ready(matmul_cpu.q8_matmul_cpu(random_x(rng, (1, 64)), q, scale))
  assert native_simd.isa("last") == isa == native_simd.isa("selected")
  assert isa in native_simd.supported()
