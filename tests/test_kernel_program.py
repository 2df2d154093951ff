"""The C++ kernel test (tests/native/kernel_test.cc) built with the system compiler and run on
this CPU: every native kernel on every SIMD path the CPU runs, against the scalar path and
float64, without JAX between them. The same program runs cross-compiled for aarch64 under
qemu-user in `.ci/run` (`tests/native/driver.py --aarch64`)."""

from __future__ import annotations

import pytest

from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd
from tests.native import driver

pytestmark = pytest.mark.skipif(
  not native_lib.available(),
  reason=f"native CPU kernel unavailable: {native_lib.unavailable_reason()}",
)


def test_every_kernel_on_every_path_this_cpu_runs(tmp_path):
  """The program builds without a warning, exits 0, and reports every kernel ok on each path
  the library runs here (`native.simd.supported()`, the same ladder as the program's)."""
  program = tmp_path / "kernel_test"
  warnings = driver.build(program)
  assert "warning" not in warnings, warnings[-3000:]
  done = driver.run([str(program)], timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  paths = native_simd.supported()
  assert paths and paths[0] == "scalar"
  assert driver.missing(done.stdout, paths) == [], done.stdout
  assert f"this CPU runs {' '.join(paths)} (of {' '.join(native_simd.ladder())})" in done.stdout


def test_the_driver_reads_a_failure():
  """A kernel reported FAIL, or not at all, on a path is missing from the program's output."""
  output = (
    "matmul            scalar        ok   48 cases\n"
    "matmul            neon          FAIL 48 cases; first failure: (1, 64, 149)\n"
  )
  gaps = driver.missing(output, ("scalar", "neon"))
  assert "matmul neon" in gaps and "matmul scalar" not in gaps
  assert "decode_attention scalar" in gaps
