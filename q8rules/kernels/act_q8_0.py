"""The Q8_0 x Q8_0 product: activations quantized to Q8_0 too, opt-in (`act_qtype="q8_0"`).

llama.cpp multiplies a Q8_0 weight by activations it first quantizes to Q8_0 blocks of 32
along K, with integer block dots (VNNI's `vpdpbusd` on x86). This is that product, chosen by
`Q8Rule(act_qtype="q8_0")` (Qwix's field for activation quantization) or
`q8_matmul(..., act_qtype="q8_0")`. The weight-only product (`act_qtype=None`, the default)
is float32-accurate; this one is not: each activation is rounded to one of 255 levels of its
block's absmax (relative error about 0.4 % of ‖x‖ per block), as in llama.cpp.

Numerics, the same in every implementation to float32 rounding:
  xq, dx = Q8_0(x) per row, blocks of 32 along K: gguf.quants' quantizer bit for bit
           (`q8rules.q8_0.quantize`), dx the float16 scale as GGUF stores it, widened;
  y[r, n] = sum_b (dx[r, b] * dw[b, n]) * sum_i xq[r, 32b + i] * q[32b + i, n],
accumulated in float32 (`reference_float64` is the float64 reference the tests hold every
implementation to, within 1e-6). Derivatives are the weight-only product's (a
straight-through estimator on the activations' rounding).

Implementations (`implementation=` picks, as for the weight-only product; `kernels.resolve`
with `act_qtype='q8_0'` chooses, `ACT_DEFAULT_ORDER` there):
  'cpu' : on a CPU with AVX-512 VNNI (and `$Q8RULES_CPU_ISA` not capping the kernel below
          AVX-512), the native kernel's int8 product (`cpu_native.q8_matmul_cpu_act_q8`:
          exact int32 block dots); elsewhere the activations' Q8_0 round trip (`round_trip`:
          dx * xq, exact in float32) through the native kernel's float32 product, which is as
          fast as the weight-only product there (XLA's int8 dot on a CPU ran 10-25x slower).
          Reads a stacked layer in place either way.
  'xla' : the round trip through XLA's weight-only product (`xla_chunked`), on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels import cpu_native
from q8rules.kernels.problem import Problem
from q8rules.kernels.xla_chunked import q8_matmul_xla
from q8rules.q8_0 import BLOCK, quantize

ACT_QTYPES = ("q8_0",)
"""The activation qtypes a product may take (None: weight-only, activations stay float)."""

IMPLEMENTATIONS = ("cpu", "xla")
"""The implementations of the Q8_0 x Q8_0 product."""


def check_act_qtype(act_qtype: object) -> None:
  """Raise a clear error unless `act_qtype` is None or one of `ACT_QTYPES`."""
  if act_qtype is not None and act_qtype not in ACT_QTYPES:
    raise ValueError(f"act_qtype={act_qtype!r}: expected None (weight-only) or one of {ACT_QTYPES}")


def cannot(name: str, p: Problem) -> str | None:
  """Why implementation `name` cannot run the Q8_0 x Q8_0 product `p` (None: it can)."""
  if name not in IMPLEMENTATIONS:
    return (
      f"{name!r} does not quantize activations (act_qtype='q8_0' runs on"
      f" {' or '.join(repr(i) for i in IMPLEMENTATIONS)})"
    )
  if name == "cpu":
    return cpu_native.cannot(p)
  return None


def int8_kernel_runs() -> bool:
  """Whether 'cpu' runs the native kernel's int8 product here (AVX-512 VNNI, the kernel's
  selected path AVX-512), rather than the round trip through its float32 product."""
  return cpu_native.has_vnni() and cpu_native.isa("selected") == "avx512"


def slower(name: str, p: Problem) -> str | None:
  """Why `implementation=None` passes `name` over: where 'cpu' runs the round trip, the
  weight-only kernel's own reason (more rows than it takes; XLA's GEMM is faster there)."""
  if name == "cpu" and not int8_kernel_runs():
    return cpu_native.slower(p)
  return None


def quantize_activations(x2d: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q8_0 of activations x2d (m, K) along K: int8 values (m, K) and float32 scales (m, K/32),
  the float16 d of GGUF's blocks widened (gguf.quants bit for bit). Non-finite values are not
  refused (activations are run-time data): they give non-finite outputs."""
  a = quantize(x2d.astype(jnp.float32), axis=1, scale_dtype=jnp.float16, check_finite=False)
  return a.q, a.scale.astype(jnp.float32)


def round_trip(x2d: jax.Array) -> jax.Array:
  """The activations as their Q8_0 blocks hold them: dx * xq, (m, K) float32 (exact: an 11-bit
  scale times a 7-bit integer). A weight-only product of it is the Q8_0 x Q8_0 product to
  float32 rounding (each dx * xq * q needs up to 25 bits)."""
  m, k = x2d.shape
  xq, dx = quantize_activations(x2d)
  blocks = xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK) * dx[:, :, None]
  return blocks.reshape(m, k)


def q8_matmul_act_xla(x2d: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`Q8_0(x2d) @ (q * scale)` in XLA: x2d (m, K) float, q (K, N) int8, scale (K/32, N) float32
  or float16 -> (m, N) float32: the round trip through `xla_chunked`'s product."""
  return q8_matmul_xla(round_trip(x2d), q, scale)


def run(
  name: str, x2d: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
  """Implementation `name` on x2d (m, K) and the weight q (K, N), scale (K/32, N) or, with
  `layer`, layer `layer` of stacked q (L, K, N), scale (L, K/32, N); (m, N) float32."""
  if name == "cpu":
    if int8_kernel_runs():
      return cpu_native.q8_matmul_cpu_act_q8(x2d, q, scale, layer)
    if layer is None:
      return cpu_native.q8_matmul_cpu(round_trip(x2d), q, scale)
    return cpu_native.q8_matmul_cpu_layer(round_trip(x2d), q, scale, layer)
  if layer is not None:
    q = jax.lax.dynamic_index_in_dim(q, layer, 0, keepdims=False)
    scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)
  return q8_matmul_act_xla(x2d, q, scale)


def reference_float64(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """The product in numpy float64 from the same Q8_0 activations (for tests and benchmarks):
  (m, K) float, (K, N) int8, (K/32, N) -> (m, N) float64."""
  xq, dx = (np.asarray(a) for a in quantize_activations(jnp.asarray(x, jnp.float32)))
  m, k = xq.shape
  nb = k // BLOCK
  dots = np.einsum(
    "mbi,bin->mbn",
    xq.reshape(m, nb, BLOCK).astype(np.int64),
    np.asarray(q).reshape(nb, BLOCK, -1).astype(np.int64),
  )
  d = dx.astype(np.float64)[:, :, None] * np.asarray(scale, np.float64)[None]
  return np.sum(dots * d, axis=1)
