"""'cpu': the weight-only product on the native CPU library (`kernels/native/`, built
from `kernels/cpu/`).

`q8_matmul_cpu(x, q, scale)` reads each int8 row once, converts it in registers and folds it
into per-block float32 sums for every x row (the fold's numerics: per 32-row block
`s = sum_i x_i q_i`, then `y += d * s`). The SIMD path (AVX-512, else AVX2/FMA/F16C, else
scalar) is chosen at run time; `$Q8RULES_CPU_ISA` (avx512, avx2, scalar, auto) caps it, read
on every call. `vmap` folds a batch of x into the kernel's rows; derivatives are linear XLA
(`xla_chunked`). Timings: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.matmul._bilinear import bilinear_product
from q8rules.kernels.native.library import TARGET, TARGET_LAYER, available, unavailable_reason
from q8rules.kernels.problem import Problem

NAME = "cpu"
SUMMARY = "the native CPU kernel (C++ through XLA's FFI, built on first use)"
ROUNDS_WEIGHT = False
"""Every product is exact; only the float32 accumulation rounds."""

CPU_MAX_ROWS = 16
"""The most activation rows for which `implementation=None` runs the native CPU kernel on CPU
(past that XLA's GEMM is faster; benchmarks/RESULTS.md)."""


def _check_available() -> None:
  if not available():
    raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")


def _ffi_product(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """One kernel call: x (M, K) float32, q (K, N) int8, scale (K/32, N) -> (M, N) float32."""
  m = x.shape[0]
  n = q.shape[1]
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(x, q, scale)


_product_diff = bilinear_product(_ffi_product)


def q8_matmul_cpu(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`x @ (q * scale)` with the native CPU kernel.

  Args:
    x: (M, K) float32, bfloat16 or float16 activations (converted to float32,
      exactly).
    q: (K, N) int8 Q8_0 values, K a multiple of 32.
    scale: (K/32, N) float32 or float16 Q8_0 scales (float16 widened in the
      kernel).

  Returns:
    (M, N) float32, accumulated in float32 per 32-row block.

  The operands are trusted (`q8_matmul` checks them: `problem.check_operands`).

  Raises:
    RuntimeError: the kernel is unavailable here (`unavailable_reason()`).
  """
  m, k = x.shape
  n = q.shape[1]
  _check_available()
  x = x.astype(jnp.float32)
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), jnp.float32)
  return _product_diff(x, q, scale)


def cannot(p: Problem) -> str | None:
  """Why the native kernel cannot run `p`: not on the CPU, or not built here (None: it can)."""
  if p.platform != "cpu":
    return f"the native CPU kernel runs on the CPU only, not {p.platform}"
  if not available():
    return f"the native CPU kernel is unavailable here: {unavailable_reason()}"
  return None


CPU_SMALL_WEIGHT = 1 << 20
"""Weights of at most this many values (K * N) run the native kernel up to `CPU_MAX_ROWS_SMALL`
rows: at such sizes XLA's per-call costs outweigh its GEMM (SmolLM-135M's 576-wide layers
prefill 1.8x faster with the kernel; benchmarks/RESULTS.md)."""

CPU_MAX_ROWS_SMALL = 128
"""The most activation rows the native kernel takes for a weight of <= `CPU_SMALL_WEIGHT`
values."""


def slower(p: Problem) -> str | None:
  """Why `implementation=None` passes the kernel over: more than `CPU_MAX_ROWS` rows (more than
  `CPU_MAX_ROWS_SMALL` for a weight of at most `CPU_SMALL_WEIGHT` values)."""
  if p.k * p.n <= CPU_SMALL_WEIGHT:
    if p.m > CPU_MAX_ROWS_SMALL:
      return f"m={p.m} > {CPU_MAX_ROWS_SMALL} rows (XLA's GEMM is faster there)"
    return None
  if p.m > CPU_MAX_ROWS:
    return f"m={p.m} > {CPU_MAX_ROWS} rows (XLA's GEMM is faster there)"
  return None


def q8_matmul_cpu_layer(
  x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array
) -> jax.Array:
  """`x @ (q[layer] * scale[layer])` with the native kernel reading layer `layer` of the stacked
  arrays in place (no slice is copied).

  Args:
    x: (M, K) activations (converted to float32, exactly).
    q: (L, K, N) int8 stacked Q8_0 values, K a multiple of 32.
    scale: (L, K/32, N) float32 or float16 scales.
    layer: () int32, in [0, L) (the kernel fails the call, naming the index, otherwise).

  Returns:
    (M, N) float32, as `q8_matmul_cpu(x, q[layer], scale[layer])`.
  """
  m, k = x.shape
  n = q.shape[2]
  _check_available()
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), jnp.float32)
  out = jax.ShapeDtypeStruct((m, n), jnp.float32)
  index = jnp.asarray(layer, jnp.int32)
  return jax.ffi.ffi_call(TARGET_LAYER, out)(x.astype(jnp.float32), q, scale, index)


def run(x2d: jax.Array, q: jax.Array, scale: jax.Array, platform: str, interpret: bool | None):
  """The registry's call: `q8_matmul_cpu(x2d, q, scale)`, (m, N) float32."""
  del platform, interpret
  return q8_matmul_cpu(x2d, q, scale)


def run_layer(x2d: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array) -> jax.Array:
  """The registry's call on one layer of stacked weights, read in place:
  `q8_matmul_cpu_layer(x2d, q, scale, layer)`, (m, N) float32."""
  return q8_matmul_cpu_layer(x2d, q, scale, layer)


__all__ = [
  "CPU_MAX_ROWS",
  "CPU_MAX_ROWS_SMALL",
  "CPU_SMALL_WEIGHT",
  "NAME",
  "ROUNDS_WEIGHT",
  "SUMMARY",
  "cannot",
  "q8_matmul_cpu",
  "q8_matmul_cpu_layer",
  "run",
  "run_layer",
  "slower",
]
