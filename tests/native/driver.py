"""Builds and runs the C++ kernel test (tests/native/kernel_test.cc): every native kernel on
every SIMD path a CPU runs, against the scalar path and float64.

On this machine (`build` then `run`: tests/test_kernel_program.py, in the README's test command)
with the system compiler; and, as a script, cross-compiled for aarch64 with Debian's
`aarch64-linux-gnu-g++` (the library itself too, as `library.py` builds it, without a warning)
and run under `qemu-aarch64-static` twice, on a CPU model with ARMv8.2's sdot (`-cpu max`:
scalar, neon and neon_dotprod run) and one without (`-cpu cortex-a57`: scalar and neon), as a
step of `.ci/run`:

  apt-get install qemu-user-static g++-aarch64-linux-gnu
  python tests/native/driver.py --aarch64

The program is compiled with the library's own flags (`library.CXXFLAGS`, less those of a shared
object) against the library's headers and XLA's FFI headers (`jax.ffi.include_dir()`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from q8rules.kernels.native import library

SOURCE = Path(__file__).with_name("kernel_test.cc")
"""The C++ test program."""

HEADERS = library.SOURCE.parent
"""The native library's headers, which the program includes."""

CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64-static"
SYSROOT = "/usr/aarch64-linux-gnu"
"""Debian's cross compiler, qemu-user and the aarch64 libraries it loads the program with."""

QEMU_CPUS = {"max": ("scalar", "neon", "neon_dotprod"), "cortex-a57": ("scalar", "neon")}
"""qemu's CPU models the program runs on, and the paths each must run: `max` has sdot
(ARMv8.2 dotprod), the Cortex-A57 (ARMv8.0) does not."""

KERNELS = (
  "matmul",
  "matmul_act_q8",
  "act_quantize",
  "matmul_t",
  "ragged",
  "ragged_act_q8",
  "decode_attention",
  "decode_attn_bf16",
  "q8_0_blocks",
)
"""The program's kernels checked on every path (the repack has one path per architecture)."""


def flags() -> list[str]:
  """The library's compiler flags, less -fPIC and -shared, with its headers and XLA's."""
  own = [f for f in library.CXXFLAGS if f not in ("-fPIC", "-shared")]
  return [*own, "-I", str(HEADERS), "-isystem", jax.ffi.include_dir()]


def build(out: Path, cxx: list[str] | None = None) -> str:
  """Compile the program into `out` with `cxx` (default: the library's compiler, `$CXX` or
  c++); returns what the compiler printed (warnings). RuntimeError when it fails."""
  cmd = [*(cxx or library.compiler()), *flags(), "-o", str(out), str(SOURCE)]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if done.returncode != 0:
    raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
  return done.stderr


def build_library(out: Path, cxx: list[str]) -> str:
  """Compile the library (`library.SOURCE`) into `out` with `cxx` and the library's own flags,
  as `library.py` builds it; returns what the compiler printed. RuntimeError when it fails."""
  cmd = [*cxx, *library.CXXFLAGS, "-isystem", jax.ffi.include_dir(), "-o", str(out)]
  done = subprocess.run([*cmd, str(library.SOURCE)], capture_output=True, text=True, timeout=600)
  if done.returncode != 0:
    raise RuntimeError(f"compiling {library.SOURCE.name} failed:\n{done.stderr[-4000:]}")
  return done.stderr


def run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
  """Run the built program (`cmd`: its path, or qemu's command line with it), output captured."""
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def lines_for(output: str, path: str) -> dict[str, str]:
  """The program's verdict ('ok' or 'FAIL') per kernel on `path`, from its output."""
  verdicts = {}
  for line in output.splitlines():
    parts = line.split()
    if len(parts) >= 3 and parts[1] == path:
      verdicts[parts[0]] = parts[2]
  return verdicts


def missing(output: str, paths: tuple[str, ...]) -> list[str]:
  """'kernel path' for each kernel of KERNELS the output does not report as ok on each path."""
  gaps = []
  for path in paths:
    verdicts = lines_for(output, path)
    gaps += [f"{k} {path}" for k in KERNELS if verdicts.get(k) != "ok"]
  return gaps


def aarch64() -> int:
  """Cross-build the library and the program for aarch64, and run the program under qemu on
  each of QEMU_CPUS; 0 when both build without a warning and every run passes and runs every
  path its CPU has, else 1."""
  for tool in (CROSS_CXX, QEMU):
    if shutil.which(tool) is None:
      print(f"{tool} not found: apt-get install qemu-user-static g++-aarch64-linux-gnu")
      return 1
  status = 0
  with tempfile.TemporaryDirectory() as tmp:
    program = Path(tmp) / "kernel_test"
    for what, warnings in (
      (library.SOURCE.name, build_library(Path(tmp) / "q8_gemv.so", [CROSS_CXX])),
      (SOURCE.name, build(program, [CROSS_CXX])),
    ):
      print(f"--- {CROSS_CXX}: {what} built{' with warnings' if warnings.strip() else ''}")
      if warnings.strip():
        print(warnings)
        status = 1
    for cpu, paths in QEMU_CPUS.items():
      print(f"--- {QEMU} -cpu {cpu}", flush=True)
      done = run([QEMU, "-L", SYSROOT, "-cpu", cpu, str(program)])
      print(done.stdout + done.stderr, end="", flush=True)
      gaps = missing(done.stdout, paths)
      if done.returncode != 0 or gaps:
        print(f"FAILED on -cpu {cpu}: exit {done.returncode}; not ok: {', '.join(gaps) or '-'}")
        status = 1
      if cpu == "cortex-a57" and lines_for(done.stdout, "neon_dotprod"):
        print("FAILED: neon_dotprod ran on a CPU without sdot")
        status = 1
  return status


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--aarch64", action="store_true", help="cross-build for aarch64 and run under qemu-user"
  )
  args = parser.parse_args()
  if args.aarch64:
    return aarch64()
  with tempfile.TemporaryDirectory() as tmp:
    program = Path(tmp) / "kernel_test"
    print(build(program), end="")
    done = run([str(program)])
    print(done.stdout + done.stderr, end="")
    return done.returncode


if __name__ == "__main__":
  sys.exit(main())
