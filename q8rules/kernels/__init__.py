"""One product, several implementations, one switch: `q8_matmul`.

`y = x @ W` for a Q8_0 weight W (K x N, blocked along K), with fp32
accumulation. Implementations (tokamax's convention, `implementation=`):

  'pallas'     the fold kernel (TPU Mosaic / GPU Triton; `interpret=True` on CPU),
               for decode-shaped products (`q8_gemv_applies`)
  'xla'        K-chunked dequantise-and-dot, every shape, every backend
  'cpu'        the native C++ kernel (XLA FFI, built on first use; x86-64, CPU
               backend): one read of the int8 weight, converted in registers,
               for up to 16 rows at a time (`q8rules.kernels.cpu`)
  'reference'  dequantise the whole weight, then dot (the yardstick; slow)
  None         the best for the backend and shape, always falling back to 'xla'
               (on CPU: 'cpu' for m <= CPU_MAX_ROWS when it is available and
               CPU_BY_DEFAULT is set)
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels import cpu as _cpu
from q8rules.kernels.fold import q8_fold, q8_gemv_applies, q8_gemv_reason
from q8rules.kernels.reference import q8_matmul_reference
from q8rules.kernels.xla import q8_matmul_xla
from q8rules.q8_0 import BLOCK, Q8Array

Implementation = Literal["xla", "pallas", "cpu", "reference"] | None
IMPLEMENTATIONS = ("xla", "pallas", "cpu", "reference")

CPU_BY_DEFAULT = True
"""Whether `implementation=None` picks the native CPU kernel on CPU (for m <= CPU_MAX_ROWS).

False for now: tests of other parts (test_fold, test_provider, test_demo) pin the CPU path to
'xla'. Setting it True makes the kernel the CPU default once those expectations are updated;
until then ask for it with `implementation='cpu'` or `Q8Rule(implementation='cpu')`."""

CPU_MAX_ROWS = 16
"""The most activation rows (m) for which `implementation=None` would run the native CPU kernel
(it reads the weight once per 16 rows). Measured on the 2-core EPYC (weights from DRAM, ms,
kernel / XLA path): K = N = 4096: m = 1 0.78 / 1.44, 2 0.88 / 1.87, 4 1.41 / 1.69,
6 1.60 / 2.33, 8 2.34 / 2.48, 16 3.62 / 3.63; K = N = 8192: m = 1 2.64 / 6.23,
8 9.3 / 10.3, 16 14.9 / 16.0. From m = 8 both are FMA-bound; past 16 rows the kernel streams
the weight again per 16 rows and XLA's GEMM wins (m = 64: about 1.35x)."""
ACTIVATION_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def check_operands(x: jax.Array, w: Q8Array, *, what: str = "q8_matmul") -> None:
  """Raise a clear error when x (..., K) and the Q8_0 weight (K, N) do not fit together."""
  if not isinstance(w, Q8Array):
    raise TypeError(f"{what}: the weight must be a Q8Array, got {type(w).__name__}")
  if w.ndim != 2 or w.axis != 0:
    raise ValueError(
      f"{what}: the weight must be 2-D (K, N) blocked along axis 0, got shape"
      f" {w.shape} blocked along axis {w.axis}"
    )
  if np.dtype(w.q.dtype) != np.dtype(np.int8):
    raise TypeError(f"{what}: Q8_0 values must be int8, got {w.q.dtype}")
  if np.dtype(w.scale.dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
    raise TypeError(f"{what}: Q8_0 scales must be float32 or float16, got {w.scale.dtype}")
  k, n = w.shape
  if k % BLOCK or tuple(w.scale.shape) != (k // BLOCK, n):
    raise ValueError(
      f"{what}: scale shape {tuple(w.scale.shape)} does not match values {w.shape}"
      f" (expected ({k // BLOCK}, {n}) with K a multiple of {BLOCK})"
    )
  if np.dtype(x.dtype) not in ACTIVATION_DTYPES:
    raise TypeError(f"{what}: activations must be float32, bfloat16 or float16, got {x.dtype}")
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(
      f"{what}: activations of shape {tuple(x.shape)} do not contract with a weight of K={k} rows"
    )


def cpu_kernel_applies(m: int, *, by_default: bool | None = None) -> bool:
  """Whether `pick_implementation` sends an (m, K) x (K, N) product on CPU to the native kernel:
  `by_default` (None: `CPU_BY_DEFAULT`), 0 < m <= `CPU_MAX_ROWS`, and the kernel is available."""
  by_default = CPU_BY_DEFAULT if by_default is None else by_default
  return by_default and 0 < m <= CPU_MAX_ROWS and _cpu.available()


def pick_implementation(
  m: int, k: int, n: int, *, backend: str | None = None, itemsize: int = 2
) -> str:
  """The implementation `implementation=None` runs for an (m, K) x (K, N) product.

  'pallas' (the fold) on TPU and GPU when `q8_gemv_applies(m, k, n)` (itemsize:
  bytes of an activation value). On CPU, when `CPU_BY_DEFAULT`, 'cpu' (the
  native kernel) for m <= `CPU_MAX_ROWS` where `q8rules.kernels.cpu.available()`
  (which builds it on the first call); never the fold (interpret mode, ~30x
  slower). 'xla' otherwise.
  """
  backend = (backend or jax.default_backend()).lower()
  if backend == "cpu":
    return "cpu" if cpu_kernel_applies(m) else "xla"
  if backend in ("tpu", "gpu", "cuda", "rocm") and q8_gemv_applies(
    m, k, n, backend=backend, itemsize=itemsize
  ):
    return "pallas"
  return "xla"


def q8_matmul(
  x: jax.Array,
  w: Q8Array,
  *,
  implementation: Implementation = None,
  interpret: bool | None = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """`y = x @ W` for x (..., K) float32/bfloat16/float16 and W a (K, N) Q8Array.

  Accumulates in float32 and returns (..., N) in `preferred_element_type`
  (default: x's dtype). The fold runs only where the product is decode-shaped
  (`q8_gemv_reason` says why not); `interpret` runs it in Pallas interpret mode
  (None: on CPU).
  """
  check_operands(x, w)
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(
      f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
    )
  k, n = w.shape
  x2d = x.reshape(-1, k)
  itemsize = np.dtype(x.dtype).itemsize
  impl = implementation or pick_implementation(x2d.shape[0], k, n, itemsize=itemsize)
  if impl == "xla":
    y = q8_matmul_xla(x2d, w.q, w.scale)
  elif impl == "cpu":
    if not _cpu.available():
      raise RuntimeError(
        f"implementation='cpu': the native CPU kernel is unavailable here:"
        f" {_cpu.unavailable_reason()}; use 'xla'"
      )
    y = _cpu.q8_matmul_cpu(x2d, w.q, w.scale)
  elif impl == "reference":
    y = q8_matmul_reference(x2d, w.q, w.scale)
  else:
    reason = q8_gemv_reason(x2d.shape[0], k, n, itemsize=itemsize)
    if reason:
      raise ValueError(f"implementation='pallas': the fold does not apply: {reason}; use 'xla'")
    y = q8_fold(x2d, w.q, w.scale, interpret=interpret)
  return y.reshape(*x.shape[:-1], n).astype(preferred_element_type or x.dtype)


__all__ = [
  "CPU_BY_DEFAULT",
  "CPU_MAX_ROWS",
  "IMPLEMENTATIONS",
  "check_operands",
  "cpu_kernel_applies",
  "pick_implementation",
  "q8_fold",
  "q8_gemv_applies",
  "q8_gemv_reason",
  "q8_matmul",
]
