"""The native CPU library (`cpu/library.cc` and its headers): built on first use, loaded, and
its FFI targets registered; its run-time queries; the GGUF repack.

The ops' 'cpu' implementations call it through XLA's FFI (`kernels/matmul/cpu.py`,
`kernels/matmul_act_q8/cpu.py`, `kernels/matmul_t/cpu.py`, `kernels/decode_attention/cpu.py`).
The first use per process compiles the source with `$CXX` (default `c++`, warnings on) into `$Q8RULES_CACHE` (default
`~/.cache/q8rules`), named by a hash of sources, jaxlib, compiler and flags; `available()` is
False, with `unavailable_reason()`, where that cannot happen (not x86-64, no compiler, a failed
build). It loads whatever JAX's default backend is: on a GPU or TPU host the GGUF repack runs
on it, and the CPU kernels serve programs lowered for the CPU. The SIMD path (AVX-512, else
AVX2/FMA/F16C, else scalar) is chosen at run time; `$Q8RULES_CPU_ISA` (avx512, avx2, scalar,
auto) caps it, read on every call.

Threads: a native call (a product, a transposed product, a repack, a requantization) runs on
the calling thread and up to `max_threads() - 1` helpers: by default every CPU this process may
run on (its affinity mask: `taskset`, `q8rules run -t N`), at most `set_threads(n)` /
`$Q8RULES_THREADS` when set (docs/kernels.md, "Threads", says how the work is split). A
product's helpers are the library's own threads, which spin `$Q8RULES_SPIN_US` microseconds
(`spin_us()`) for the next product before they sleep; a product that finds them busy (another
thread's product) takes threads of XLA's pool instead.
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
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib
import numpy as np

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

TARGET_DECODE_ATTENTION = "q8rules_decode_attention"
"""The FFI target of one new token's attention over a layer of the KV cache
(`q8rules.kernels.decode_attention`)."""

SOURCE = Path(__file__).with_name("cpu") / "library.cc"
"""The library's C++ source (its FFI handlers and C functions), shipped as package data; each
op's code is a header beside it."""

HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))
"""The headers SOURCE includes, one per op plus the SIMD helpers and the FFI bindings (their
bytes enter the library's cache key)."""

CXXFLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra")
"""Compiler flags, warnings on (the compiler's output is kept beside the library: `build_log`).
No `-mavx2`: the AVX2 functions carry target attributes, so the scalar fallback stays runnable
on any x86-64 CPU. `-pthread`: the repack starts threads (a glibc before 2.34 keeps them in
libpthread). XLA's FFI headers come in with `-isystem` (their own warnings are theirs)."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" (ctypes.CDLL) or "reason" (str), once decided


def cache_dir() -> Path:
  """Where compiled kernels are kept: `$Q8RULES_CACHE`, else `~/.cache/q8rules`."""
  env = os.environ.get("Q8RULES_CACHE")
  if env:
    return Path(env).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "q8rules"


def _compiler() -> list[str]:
  """The C++ compiler command: `$CXX` (may carry arguments), default `c++`."""
  return (os.environ.get("CXX") or "c++").split()


def library_path() -> Path:
  """The cached shared library for this source, jaxlib, compiler and flags (may not exist yet)."""
  key = hashlib.sha256()
  for part in (SOURCE, *HEADERS):
    key.update(part.read_bytes())
  key.update(jaxlib.__version__.encode())
  key.update(" ".join(_compiler() + list(CXXFLAGS)).encode())
  key.update(platform.machine().encode())
  return cache_dir() / f"q8_gemv-{key.hexdigest()[:16]}.so"


def _build(out: Path) -> None:
  """Compile SOURCE into `out` (atomically: a temporary file renamed into place)."""
  cxx = _compiler()
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
      if machine not in ("x86_64", "amd64"):
        raise RuntimeError(f"the kernel is x86-64 only (this host: {machine})")
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
      ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
      lib.Q8SetThreadLimit(ctypes.c_int(thread_limit() or 0))
      lib.Q8SetSpinMicroseconds(ctypes.c_longlong(spin_us()))
      _state["lib"] = lib
      _state["path"] = path
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
      _state["reason"] = str(e)
    return _state.get("lib")  # type: ignore[return-value]


def library() -> ctypes.CDLL | None:
  """The loaded library (built on the first call), for the modules that call its C functions
  (`q8rules.checkpoint.gguf.requant_native`); None where it is unavailable."""
  return _load()


def build_log() -> str | None:
  """What the compiler printed when it built the loaded library (its command first), or None
  (not loaded, or built before the log was kept)."""
  path = loaded_path()
  log = path.with_suffix(".log") if path is not None else None
  return log.read_text() if log is not None and log.exists() else None


def reset() -> None:
  """Forget the loaded library (the next use loads it again): for tests."""
  with _lock:
    _state.clear()


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


ISAS = ("scalar", "avx2", "avx512")
"""The kernel's SIMD paths, by the codes its `Q8Gemv*Isa` functions return."""


def isa(which: str = "best") -> str | None:
  """A SIMD path of the loaded kernel: 'best' (what this CPU has), 'selected' (what the next
  call runs, after `$Q8RULES_CPU_ISA` and `force_scalar`) or 'last' (what the last call
  ran); None when the kernel is unavailable."""
  lib = _load()
  if lib is None:
    return None
  fn = {"best": lib.Q8GemvBestIsa, "selected": lib.Q8GemvSelectedIsa, "last": lib.Q8GemvLastIsa}
  return ISAS[fn[which]()]


def has_avx2() -> bool:
  """Whether the loaded kernel runs a SIMD path on this CPU (False if unavailable)."""
  lib = _load()
  return bool(lib is not None and lib.Q8GemvHasAvx2())


def last_threads() -> int:
  """The threads (the caller and pool helpers) the kernel's last call ran on: 0 before the
  first call or when the kernel is unavailable."""
  lib = _load()
  return 0 if lib is None else int(lib.Q8GemvLastThreads())


def has_vnni() -> bool:
  """Whether the loaded kernel's Q8_0-activation product runs its AVX-512 VNNI path on this CPU
  (False: its scalar path, or the kernel is unavailable)."""
  lib = _load()
  return bool(lib is not None and lib.Q8GemvHasVnni())


def last_act_path() -> str | None:
  """The path the last Q8_0-activation product ran: 'avx512_vnni' or 'scalar' (None: none
  has run, or the kernel is unavailable)."""
  lib = _load()
  code = -1 if lib is None else int(lib.Q8GemvLastActVnni())
  return None if code < 0 else ("avx512_vnni" if code else "scalar")


def quantize_activations_native(
  x: np.ndarray, simd: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The kernel's own Q8_0 of float32 rows x (m, K), as the Q8_0-activation product uses it:
  int8 values (m, K), float32 scales (m, K/32: the float16 d widened) and int32 -128 * each
  block's sum of values; on AVX-512 with `simd` where the CPU has VNNI, else scalar (tests)."""
  lib = _load()
  if lib is None:
    raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")
  x = np.ascontiguousarray(x, np.float32)
  m, k = x.shape
  if k % 32:
    raise ValueError(f"quantize_activations_native: K = {k} is not a multiple of 32")
  xq = np.empty((m, k), np.int8)
  dx = np.empty((m, k // 32), np.float32)
  xc = np.empty((m, k // 32), np.int32)
  ptr, i64 = ctypes.c_void_p, ctypes.c_int64
  lib.Q8QuantizeActivations(
    ptr(x.ctypes.data),
    i64(m),
    i64(k),
    ptr(xq.ctypes.data),
    ptr(dx.ctypes.data),
    ptr(xc.ctypes.data),
    ctypes.c_int(int(simd)),
  )
  return xq, dx, xc


def force_scalar(force: bool) -> None:
  """Run the scalar fallback even on an AVX2 CPU (True) or stop forcing it (False); for tests."""
  lib = _load()
  if lib is None:
    raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")
  lib.Q8GemvForceScalar(int(force))


REPACK_THREAD_BYTES = 1 << 18
"""A repack splits its work over threads only for at least this many bytes (below it, starting a
thread costs about what it saves): whole tensors to each thread when a call repacks several (a
stack's layers), else the rows of the one tensor."""


def cpus() -> int:
  """The threads a native call may use: the CPUs this process may run on (a `taskset` is
  honoured), at most the limit of `set_threads` / `$Q8RULES_THREADS`."""
  try:
    n = max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # not Linux
    n = max(1, os.cpu_count() or 1)
  limit = thread_limit()
  return min(n, limit) if limit else n


THREADS_ENV = "Q8RULES_THREADS"
"""The environment variable of the native calls' thread limit (a positive integer)."""


def _positive(n: object, what: str) -> int:
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"{what} must be a positive integer (threads per native call), got {n!r}")
  return n


def thread_limit() -> int | None:
  """The limit on a native call's threads: `set_threads`'s, else `$Q8RULES_THREADS`, else None
  (every CPU this process may run on). ValueError naming the variable when it is not a
  positive integer."""
  if "threads" in _state:
    return _state["threads"]  # type: ignore[return-value]
  text = os.environ.get(THREADS_ENV, "").strip()
  if not text:
    return None
  try:
    return _positive(int(text), f"${THREADS_ENV}={text!r}")
  except ValueError:
    raise ValueError(
      f"${THREADS_ENV}={text!r} must be a positive integer (threads per native call)"
    ) from None


SPIN_ENV = "Q8RULES_SPIN_US"
"""The environment variable of the time a product's helper threads spin for the next product
before they sleep, in microseconds (a non-negative integer; 0: they sleep at once)."""
DEFAULT_SPIN_US = 200
"""`spin_us()` when `$Q8RULES_SPIN_US` is not set: long enough to span the other work between
two products of a decode step, short enough that an idle process soon stops spinning."""


def spin_us() -> int:
  """How long a product's helper threads spin for the next product before they sleep
  (microseconds): `$Q8RULES_SPIN_US`, else `DEFAULT_SPIN_US`. ValueError naming the variable
  when it is not a non-negative integer. Read when the library loads."""
  text = os.environ.get(SPIN_ENV, "").strip()
  if not text:
    return DEFAULT_SPIN_US
  try:
    us = int(text)
  except ValueError:
    us = -1
  if us < 0:
    raise ValueError(f"${SPIN_ENV}={text!r} must be a non-negative integer (microseconds)")
  return us


def set_threads(n: int | None) -> None:
  """Run each native call on at most `n` threads, the caller included (None: as many as the
  process's CPUs; this replaces `$Q8RULES_THREADS`). Process-wide, from the next call on; the
  outputs are the same bit for bit whatever the threads (the work is cut by the problem alone).
  """
  if n is not None:
    _positive(n, "threads")
  _state["threads"] = n
  lib = _load()
  if lib is not None:
    lib.Q8SetThreadLimit(ctypes.c_int(n or 0))


def max_threads() -> int:
  """The threads a native call may use now (the caller included): `cpus()`; 0 when the
  library is unavailable."""
  lib = _load()
  return 0 if lib is None else int(lib.Q8MaxThreads())


Q8_0_TYPE = 8
"""GGML's type id of Q8_0: `repack_q8_transposed`'s default source type."""


def repack_q8_transposed(
  blocks: np.ndarray | Sequence[np.ndarray],
  out: np.ndarray,
  scale_out: np.ndarray | None = None,
  *,
  source_types: int | Sequence[int] = Q8_0_TYPE,
) -> bool:
  """Write the int8 values (and, with `scale_out`, the float16 scales) of GGUF Q8_0 rows into
  the kernel layout, read straight from the file's blocks; False (nothing written) when the
  native library is unavailable here or does not read a source type.

  Args:
    blocks: uint8, C-contiguous: batch x rows rows of nb 34-byte blocks (a little-endian
      float16 scale and 32 int8 values each), `batch` (N = rows, K = nb * 32) tensors as GGUF
      stores them; or a sequence of `batch` such arrays, one tensor each (e.g. a stack's
      layers, each a view of the file's mapping).
    out: (batch, K, rows) int8 whose last axis is contiguous: C-contiguous, or a column
      range of a wider array (`wide[:, :, n0:n0 + rows]`, each (K, rows) a view with
      `wide`'s row stride).
    scale_out: None, or (batch, nb, rows) float16 laid out as `out` (C-contiguous or a column
      range of a wider array): the blocks' scales, transposed, in the same pass.
    source_types: the GGML type id of the tensors' rows, one for all or one a tensor
      (little-endian blocks of that type, K values a row). A tensor of another type than Q8_0
      is requantized to Q8_0 on the way, in the same pass, bit for bit as
      `gguf.quants.quantize(gguf.quants.dequantize(rows), Q8_0)` (its Q8_0 blocks are never
      made whole); that needs `scale_out` and `blocks` as a sequence. A block that decodes to
      a non-finite value gets gguf.quants' NaN or infinite scale: check the scales.

  One native call: its threads (this process's CPUs, for at least `REPACK_THREAD_BYTES` in
  all) start once, and take whole tensors when there are several (runs of 64 rows of any
  tensor when one is requantized).
  """
  lib = _load()
  if lib is None:
    return False
  batch, k, rows = out.shape
  nb = k // 32
  types = [int(source_types)] * batch if isinstance(source_types, int) else list(source_types)
  requantize = any(t != Q8_0_TYPE for t in types)
  tensor_bytes = {}  # a tensor's bytes, by its type
  for t in set(types):
    values, nbytes = ctypes.c_int64(), ctypes.c_int64()
    if not lib.Q8RequantBlock(ctypes.c_int(t), ctypes.byref(values), ctypes.byref(nbytes)):
      return False
    if k % values.value:
      raise ValueError(
        f"repack_q8_transposed: K = {k} is not whole blocks of GGML type {t}"
        f" ({values.value} values)"
      )
    tensor_bytes[t] = rows * k // values.value * nbytes.value
  sizes_wanted = [tensor_bytes[t] for t in types]
  parts = [blocks] if isinstance(blocks, np.ndarray) else list(blocks)
  sizes = [p.size for p in parts]
  ldd = out.strides[1] if k > 1 else rows
  batch_stride = out.strides[0] if batch > 1 else ldd * k
  if (
    len(types) != batch
    or (requantize and (scale_out is None or len(parts) != batch))
    or any(p.dtype != np.uint8 or not p.flags.c_contiguous for p in parts)
    or out.dtype != np.int8
    or out.strides[2] != 1
    or ldd < rows
    or batch_stride < ldd * k
    or k % 32
    or (len(parts) == 1 and sizes[0] != sum(sizes_wanted))
    or (len(parts) > 1 and sizes != sizes_wanted)
  ):
    raise ValueError(
      f"repack_q8_transposed: expected {batch} tensor(s) of {sizes_wanted[:4]} C-contiguous"
      f" uint8 bytes (GGML types {sorted(set(types))}; scale_out and one array a tensor"
      f" where one is requantized) for an int8 out {out.shape} with contiguous rows, got"
      f" {len(parts)} array(s) of {sizes[:4]} bytes"
      f" ({', '.join(sorted({str(p.dtype) for p in parts}))}) and {out.dtype} (strides"
      f" {out.strides})"
    )
  lds, scale_stride = ldd, batch_stride
  if scale_out is not None:
    lds = scale_out.strides[1] // 2 if nb > 1 else rows
    scale_stride = scale_out.strides[0] // 2 if batch > 1 else lds * nb
    if (
      scale_out.dtype != np.float16
      or scale_out.shape != (batch, nb, rows)
      or scale_out.strides[2] != 2
      or lds < rows
      or scale_stride < lds * nb
    ):
      raise ValueError(
        f"repack_q8_transposed: expected float16 scales {(batch, nb, rows)} with contiguous"
        f" rows, got {scale_out.dtype} {scale_out.shape} (strides {scale_out.strides})"
      )
  if len(parts) == 1:
    starts = [parts[0].ctypes.data + i * sizes_wanted[0] for i in range(batch)]
  else:
    starts = [p.ctypes.data for p in parts]
  threads = cpus() if sum(sizes_wanted) >= REPACK_THREAD_BYTES else 1
  ptr, i64 = ctypes.c_void_p, ctypes.c_int64
  strides = (i64(ldd), i64(lds), i64(batch_stride), i64(scale_stride), i64(threads))
  sources, dq = (ptr * batch)(*starts), ptr(out.ctypes.data)
  ds = ptr(None if scale_out is None else scale_out.ctypes.data)
  if not requantize:
    lib.Q8RepackKernelBatch(sources, dq, ds, i64(batch), i64(rows), i64(nb), *strides)
    return True
  code = lib.Q8RequantizeKernelBatch(
    (ctypes.c_int * batch)(*types), sources, dq, ds, i64(batch), i64(rows), i64(k), *strides
  )
  if code != 0:
    raise ValueError(f"repack_q8_transposed: the library refused GGML types {types} ({code})")
  return True
