"""'cpu': the Q8_0 x Q8_0 product on the native CPU library.

On a CPU with AVX-512 VNNI (and `$Q8RULES_CPU_ISA` not capping the kernel below AVX-512) it is
the library's int8 product (exact int32 block dots); elsewhere the activations' Q8_0 round
trip (dx * xq, exact in float32) through the library's float32 product, which is as fast as
the weight-only product there (XLA's int8 dot on a CPU ran 10-25x slower). Reads a stacked
layer in place either way.
"""

from __future__ import annotations

import jax

from q8rules.kernels import cpu_native
from q8rules.kernels.matmul_act_q8.reference import round_trip
from q8rules.kernels.problem import Problem

NAME = "cpu"
SUMMARY = "the native CPU library: int8 block dots with AVX-512 VNNI, else the round trip"


def int8_kernel_runs() -> bool:
  """Whether 'cpu' runs the native kernel's int8 product here (AVX-512 VNNI, the kernel's
  selected path AVX-512), rather than the round trip through its float32 product."""
  return cpu_native.has_vnni() and cpu_native.isa("selected") == "avx512"


def cannot(p: Problem) -> str | None:
  """The weight-only native kernel's reasons (not on the CPU, or not built here)."""
  return cpu_native.cannot(p)


def slower(p: Problem) -> str | None:
  """Where it runs the round trip, the weight-only kernel's own reason (more rows than it
  takes; XLA's GEMM is faster there)."""
  if not int8_kernel_runs():
    return cpu_native.slower(p)
  return None


def run(
  x2d: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
  """On x2d (m, K) and q (K, N), scale (K/32, N) or, with `layer`, layer `layer` of stacked
  q (L, K, N), scale (L, K/32, N) read in place: (m, N) float32."""
  if int8_kernel_runs():
    return cpu_native.q8_matmul_cpu_act_q8(x2d, q, scale, layer)
  if layer is None:
    return cpu_native.q8_matmul_cpu(round_trip(x2d), q, scale)
  return cpu_native.q8_matmul_cpu_layer(round_trip(x2d), q, scale, layer)


__all__ = ["NAME", "SUMMARY", "cannot", "int8_kernel_runs", "run", "slower"]
