"""'cpu': the grouped product on the native CPU library (`kernels/cpu/q8_ragged.h`).

Each expert that received rows is one weight-only product of the native kernel on its run of
rows (its int8 values streamed once for up to 16 of them, converted in registers), and every
unit of K of every routed expert is claimed from one counter by the caller and the library's
helper threads: a decode step hands its experts to the helpers once. An expert with no rows is
never read. Each expert's rows get that expert's native weight-only product bit for bit. The
gradient is XLA's (`api`). With Q8_0 activations (`ragged_cpu(..., act_q8=True)`, where the
CPU has AVX-512 VNNI) every row is quantized once and each expert's rows get the dense Q8_0 x
Q8_0 product's int8 block dots (`kernels.matmul_act_q8`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.matmul import cpu as matmul_cpu
from q8rules.kernels.matmul.cpu import CPU_MAX_ROWS
from q8rules.kernels.native.library import (
  TARGET_RAGGED,
  TARGET_RAGGED_ACT_Q8,
  available,
  unavailable_reason,
)
from q8rules.kernels.ragged_matmul.problem import RaggedProblem

NAME = "cpu"
SUMMARY = "the native CPU kernel, one weight-only product per routed expert (C++ through XLA's FFI)"


def ragged_cpu(
  x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, act_q8: bool = False
) -> jax.Array:
  """`out[m] = x[m] @ (q[g(m)] * scale[g(m)])` with the native kernel, (M, N) float32; with
  `act_q8`, `Q8_0(x[m]) @ ...`: x quantized to Q8_0 along K in the kernel, exact int32 block
  dots (the int8 path on AVX-512 VNNI, else its scalar twin: slow, for tests).

  Args:
    x: (M, K) float32, bfloat16 or float16 (converted to float32, exactly), K a multiple of 32.
    q: (E, K, N) int8.
    scale: (E, K/32, N) float32 or float16 (float16 widened in the kernel).
    group_sizes: (E,) int32, rows per expert in order (the kernel fails the call when a size is
      negative or they sum past M; rows past their sum get zeros).

  Raises:
    RuntimeError: the kernel is unavailable here (`unavailable_reason()`).
  """
  if not available():
    raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")
  m = x.shape[0]
  n = q.shape[2]
  out = jax.ShapeDtypeStruct((m, n), jnp.float32)
  return jax.ffi.ffi_call(TARGET_RAGGED_ACT_Q8 if act_q8 else TARGET_RAGGED, out)(
    x.astype(jnp.float32), q, scale, group_sizes.astype(jnp.int32)
  )


def cannot(p: RaggedProblem) -> str | None:
  """Why the native kernel cannot run `p`, as for the weight-only product (`matmul.cpu.cannot`:
  not on the CPU, or not built here; None: it can)."""
  return matmul_cpu.cannot(p)


def slower(p: RaggedProblem) -> str | None:
  """Why `implementation=None` passes the kernel over: more than `CPU_MAX_ROWS` rows an expert
  on average (m > 16 E), where XLA's GEMM on each expert is faster (as for one weight)."""
  if p.m > CPU_MAX_ROWS * max(p.experts, 1):
    return f"m={p.m} > {CPU_MAX_ROWS} rows an expert on average (XLA's GEMM is faster there)"
  return None


def run(x2d, q, scale, group_sizes, platform: str, interpret: bool | None) -> jax.Array:
  """The registry's call: `ragged_cpu(x2d, q, scale, group_sizes)`, (m, N) float32."""
  del platform, interpret
  return ragged_cpu(x2d, q, scale, group_sizes)


__all__ = ["NAME", "SUMMARY", "cannot", "ragged_cpu", "run", "slower"]
