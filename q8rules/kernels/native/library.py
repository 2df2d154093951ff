"""The native CPU library (`kernels/cpu/library.cc` and its headers): built on first use,
loaded, and its FFI targets registered.

The first use per process compiles the source with `$CXX` (default `c++`, warnings on) into
`$Q8RULES_CACHE` (default `~/.cache/q8rules`), named by a hash of sources, jaxlib, compiler and
flags; `available()` is False, with `unavailable_reason()`, where that cannot happen (neither
x86-64 nor aarch64, no compiler, a failed build). It loads whatever JAX's default backend is: on
a GPU or TPU host the GGUF repack runs on it, and the CPU kernels serve programs lowered for the
CPU.
Loading applies the threads' settings (`settings`: `$Q8RULES_THREADS`, `$Q8RULES_SPIN_US`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

from q8rules.kernels.native import settings

TARGET = "q8rules_q8_gemv"
"""The FFI target name the kernel is registered under (CPU platform)."""

TARGET_LAYER = "q8rules_q8_gemv_layer"
"""The FFI target of the product on one layer of stacked weights, read in place."""

TARGET_ACT_Q8 = "q8rules_q8_gemv_act_q8"
"""The FFI target of the product with Q8_0 activations (`q8rules.kernels.matmul_act_q8`)."""

TARGET_ACT_Q8_LAYER = "q8rules_q8_gemv_act_q8_layer"
"""The FFI target of the product with Q8_0 activations on one layer of stacked weights."""

TARGET_MATMUL_T = "q8rules_q8_matmul_t"
"""The FFI target of the transposed product dy @ W^T, the gradient of x @ W with respect to x
(`q8rules.kernels.matmul_t`)."""

TARGET_RAGGED = "q8rules_q8_ragged_matmul"
"""The FFI target of the grouped product of experts (`q8rules.kernels.ragged_matmul`)."""

TARGET_RAGGED_ACT_Q8 = "q8rules_q8_ragged_matmul_act_q8"
"""The FFI target of the grouped product of experts with Q8_0 activations (`act_qtype='q8_0'`)."""

TARGET_DECODE_ATTENTION = "q8rules_decode_attention"
"""The FFI target of one new token's attention over a layer of the KV cache
(`q8rules.kernels.decode_attention`)."""

SOURCE = Path(__file__).parents[1] / "cpu" / "library.cc"
"""The library's C++ source (its FFI handlers and C functions), shipped as package data; each
op's code is a header beside it."""

HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))
"""The headers SOURCE includes, one per op plus the SIMD layer and the FFI bindings (their
bytes enter the library's cache key)."""

CXXFLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra")
"""Compiler flags, warnings on (the compiler's output is kept beside the library: `build_log`).
No `-mavx2` (nor `-march` on aarch64): the AVX2 and AVX-512 functions, and those with ARMv8.2's
sdot, carry target attributes, so the scalar fallback (and plain NEON) stays runnable on any
x86-64 (aarch64) CPU. `-pthread`: the repack starts threads (a glibc before 2.34 keeps them in
libpthread). XLA's FFI headers come in with `-isystem` (their own warnings are theirs)."""

MACHINES = ("x86_64", "amd64", "aarch64", "arm64")
"""`platform.machine()` of the hosts the library builds on (lower case): x86-64 and aarch64
(little-endian: the GGUF repack reads blocks in the host's order)."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" (ctypes.CDLL) and "path", or "reason" (str), once decided


def cache_dir() -> Path:
  """Where compiled kernels are kept: `$Q8RULES_CACHE`, else `~/.cache/q8rules`."""
  env = os.environ.get("Q8RULES_CACHE")
  if env:
    return Path(env).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "q8rules"


def compiler() -> list[str]:
  """The C++ compiler command: `$CXX` (may carry arguments), default `c++`."""
  return (os.environ.get("CXX") or "c++").split()


def library_path() -> Path:
  """The cached shared library for this source, jaxlib, compiler and flags (may not exist yet)."""
  key = hashlib.sha256()
  for part in (SOURCE, *HEADERS):
    key.update(part.read_bytes())
  key.update(jaxlib.__version__.encode())
  key.update(" ".join(compiler() + list(CXXFLAGS)).encode())
  key.update(platform.machine().encode())
  return cache_dir() / f"q8_gemv-{key.hexdigest()[:16]}.so"


def _build(out: Path) -> None:
  """Compile SOURCE into `out` (atomically: a temporary file renamed into place)."""
  cxx = compiler()
  if shutil.which(cxx[0]) is None:
    raise RuntimeError(f"no C++ compiler: {cxx[0]!r} not found (set $CXX)")
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
  os.close(fd)
  cmd = [*cxx, *CXXFLAGS, "-isystem", jax.ffi.include_dir(), "-o", tmp, str(SOURCE)]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
      raise RuntimeError(
        f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
      )
    out.with_suffix(".log").write_text(f"{' '.join(cmd)}\n{done.stderr}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _load() -> ctypes.CDLL | None:
  """Build (or find) and load the library and register the FFI target, once per process."""
  with _lock:
    if "lib" in _state or "reason" in _state:
      return _state.get("lib")  # type: ignore[return-value]
    try:
      machine = platform.machine().lower()
      if machine not in MACHINES:
        raise RuntimeError(
          f"the native kernel builds for x86-64 and aarch64 only (this host: {machine})"
        )
      path = library_path()
      if not path.exists():
        _build(path)
      lib = ctypes.CDLL(str(path))
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.Q8Gemv), platform="cpu")
      jax.ffi.register_ffi_target(TARGET_LAYER, jax.ffi.pycapsule(lib.Q8GemvLayer), platform="cpu")
      for target, symbol in (
        (TARGET_ACT_Q8, lib.Q8GemvActQ8),
        (TARGET_ACT_Q8_LAYER, lib.Q8GemvActQ8Layer),
        (TARGET_MATMUL_T, lib.Q8MatmulT),
        (TARGET_DECODE_ATTENTION, lib.Q8DecodeAttention),
        (TARGET_RAGGED, lib.Q8RaggedMatmul),
        (TARGET_RAGGED_ACT_Q8, lib.Q8RaggedMatmulActQ8),
      ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
      lib.Q8SetThreadLimit(ctypes.c_int(settings.thread_limit() or 0))
      lib.Q8SetSpinMicroseconds(ctypes.c_longlong(settings.spin_us()))
      _state["lib"] = lib
      _state["path"] = path
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
      _state["reason"] = str(e)
    return _state.get("lib")  # type: ignore[return-value]


def library() -> ctypes.CDLL | None:
  """The loaded library (built on the first call), for the modules that call its C functions
  (`simd`, `threads`, `repack`, `q8rules.checkpoint.gguf.requant_native`); None where it is
  unavailable."""
  return _load()


def require() -> ctypes.CDLL:
  """The loaded library, else RuntimeError with `unavailable_reason()`."""
  lib = _load()
  if lib is None:
    raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")
  return lib


def build_log() -> str | None:
  """What the compiler printed when it built the loaded library (its command first), or None
  (not loaded, or built before the log was kept)."""
  path = loaded_path()
  log = path.with_suffix(".log") if path is not None else None
  return log.read_text() if log is not None and log.exists() else None


def reset() -> None:
  """Forget the loaded library and `threads.set_threads`'s limit (the next use loads it again,
  with the environment's settings): for tests."""
  with _lock:
    _state.clear()
    settings.forget_limit()


def loaded_path() -> Path | None:
  """The shared library this process loaded, or None."""
  _load()
  return _state.get("path")  # type: ignore[return-value]


def available() -> bool:
  """Whether the native kernel runs here (builds it on the first call; see `unavailable_reason`)."""
  return _load() is not None


def unavailable_reason() -> str | None:
  """Why `available()` is False, or None when it is True."""
  _load()
  return _state.get("reason")  # type: ignore[return-value]
