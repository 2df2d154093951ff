"""'cpu': the transposed product on the native CPU library (`kernels/cpu/q8_matmul_t.h`).

For each of K's rows the kernel converts the contiguous q row in registers, times its block's
scales, and folds it into one float32 sum per dy row (SIMD over N: AVX-512, else
AVX2/FMA/F16C, else scalar, as the weight-only product chooses); threads take runs of K's
rows. No float weight is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.matmul_t.problem import TransposedProblem
from q8rules.kernels.native import library
from q8rules.kernels.native.library import TARGET_MATMUL_T

NAME = "cpu"
SUMMARY = "the native CPU kernel (C++ through XLA's FFI), q streamed row by row"


def q8_matmul_t_cpu(dy: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`dy @ (q * scale)^T` with the native CPU kernel.

  Args:
    dy: (M, N) float32, bfloat16 or float16 (converted to float32, exactly).
    q: (K, N) int8 Q8_0 values, K a multiple of 32.
    scale: (K/32, N) float32 or float16 scales (float16 widened in the kernel).

  Returns:
    (M, K) float32: for each (r, k), one float32 sum over N of dy[r, n] * (q[k, n] * scale).

  Raises:
    RuntimeError: the native library is unavailable here.
  """
  m = dy.shape[0]
  k, n = q.shape
  if not library.available():
    raise RuntimeError(f"the native CPU kernel is unavailable: {library.unavailable_reason()}")
  if m == 0 or k == 0 or n == 0:
    return jnp.zeros((m, k), jnp.float32)
  out = jax.ShapeDtypeStruct((m, k), jnp.float32)
  return jax.ffi.ffi_call(TARGET_MATMUL_T, out)(dy.astype(jnp.float32), q, scale)


def cannot(p: TransposedProblem) -> str | None:
  """Why the native kernel cannot run `p`: not on the CPU, or not built here (None: it can)."""
  if p.platform != "cpu":
    return f"the native CPU kernel runs on the CPU only, not {p.platform}"
  if not library.available():
    return f"the native CPU kernel is unavailable here: {library.unavailable_reason()}"
  return None


MAX_ROWS = 16
"""The most dy rows for which `implementation=None` runs the native kernel: past 16, XLA's
GEMM on the chunks is faster (2 shared cores, (2048, 2048): 2.6 ms against 6.5 at 16 rows,
5.6 against 3.8 at 32, 37 against 11 at 128; (576, 1536): 0.45 against 0.52 at 16, 1.05
against 0.48 at 32). The kernel re-forms each q row's float32 values for every tile of dy
rows and sums one dot per output, which suits decode-sized batches."""


def slower(p: TransposedProblem) -> str | None:
  """Why `implementation=None` passes the kernel over: more than `MAX_ROWS` rows."""
  if p.m > MAX_ROWS:
    return f"m={p.m} > {MAX_ROWS} rows (XLA's GEMM on the chunks is faster there)"
  return None


def run(dy2d: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """The registry's call: `q8_matmul_t_cpu(dy2d, q, scale)`, (m, K) float32."""
  return q8_matmul_t_cpu(dy2d, q, scale)


__all__ = ["MAX_ROWS", "NAME", "SUMMARY", "cannot", "q8_matmul_t_cpu", "run", "slower"]
