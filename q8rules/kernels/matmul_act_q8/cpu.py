"""'cpu': the Q8_0 x Q8_0 product on the native CPU library.

The library's int8 product (exact int32 block dots, llama.cpp's numerics) on every SIMD path:
AVX-512 VNNI, AVX2 (also AVX-512 without VNNI), NEON with or without `sdot`, else scalar
(`native.simd.act_path`); each path gives the same bits. Reads a stacked layer in place.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels.matmul import cpu as weight_only
from q8rules.kernels.native import library, simd
from q8rules.kernels.native.library import TARGET_ACT_Q8, TARGET_ACT_Q8_LAYER
from q8rules.kernels.problem import Problem

NAME = "cpu"
SUMMARY = "the native CPU library: int8 block dots (AVX-512 VNNI, AVX2, NEON, scalar)"


def q8_matmul_cpu_act_q8(
  x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
  """`Q8_0(x) @ (q * scale)`: the product with x quantized to Q8_0 along K in the kernel
  (`q8rules.kernels.matmul_act_q8`), on the whole weight or, with `layer`, on layer `layer` of
  stacked q (L, K, N) and scale (L, K/32, N) read in place.

  Args:
    x: (M, K) activations (converted to float32, exactly).
    q: (K, N) or (L, K, N) int8 Q8_0 values, K a multiple of 32.
    scale: (K/32, N) or (L, K/32, N) float32 or float16 scales.
    layer: None, or () int32 in [0, L).

  Returns:
    (M, N) float32: exact int32 block dots, each folded in with its two scales' product.
  """
  m, k = x.shape
  n = q.shape[-1]
  library.require()
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), jnp.float32)
  out = jax.ShapeDtypeStruct((m, n), jnp.float32)
  x = x.astype(jnp.float32)
  if layer is None:
    return jax.ffi.ffi_call(TARGET_ACT_Q8, out)(x, q, scale)
  return jax.ffi.ffi_call(TARGET_ACT_Q8_LAYER, out)(x, q, scale, jnp.asarray(layer, jnp.int32))


def cannot(p: Problem) -> str | None:
  """The weight-only native kernel's reasons (not on the CPU, or not built here)."""
  return weight_only.cannot(p)


def slower(p: Problem) -> str | None:
  """None: the int8 product runs every row count (it reads the weight once per 16 rows, and
  its block dots are cheaper than a float32 product's)."""
  del p
  return None


def run(
  x2d: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
  """On x2d (m, K) and q (K, N), scale (K/32, N) or, with `layer`, layer `layer` of stacked
  q (L, K, N), scale (L, K/32, N) read in place: (m, N) float32."""
  return q8_matmul_cpu_act_q8(x2d, q, scale, layer)


def quantize_activations_native(
  x: np.ndarray, isa: str = "scalar"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The kernel's own Q8_0 of float32 rows x (m, K), as the Q8_0-activation product uses it:
  int8 values (m, K), float32 scales (m, K/32: the float16 d widened) and int32 -128 * each
  block's sum of values; by the quantizer of `isa`'s int8 path (a name of
  `native.simd.ISAS`; scalar where this CPU lacks it), for tests."""
  lib = library.require()
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
    ctypes.c_int(simd.ISAS.index(isa)),
  )
  return xq, dx, xc


__all__ = [
  "NAME",
  "SUMMARY",
  "cannot",
  "q8_matmul_cpu_act_q8",
  "quantize_activations_native",
  "run",
  "slower",
]
