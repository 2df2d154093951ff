"""What one Q8_0 product is: its operands (`check_operands`) and its `Problem` (shape, platform).

`x (..., K) @ W` for a Q8_0 weight W = q int8 (K, N) * scale (K/32, N). The implementations
(`kernels/matmul/`: `fold`, `cpu`, `xla_chunked`, `xla_dequant`, `reference`) each judge a `Problem`
(`cannot`, `slower`) and trust the operands they are given: `check_operands` is the one check,
run at the public entry points (`q8_matmul`, `run_product`, `q8_fold`, the sharded product).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.q8_0 import BLOCK, Q8Array

PLATFORMS = ("cpu", "gpu", "tpu")
"""The platforms `resolve` knows ('cuda' and 'rocm' are 'gpu')."""

PLATFORM_OF = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
"""The platform of each backend or lowering-platform name."""

ACTIVATION_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
"""The dtypes activations may have."""

SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
"""The dtypes Q8_0 scales may have."""


def platform_of(backend: str | None = None) -> str:
  """'cpu', 'gpu' or 'tpu' for a backend or platform name (None: `jax.default_backend()`)."""
  name = (backend or jax.default_backend()).lower()
  if name not in PLATFORM_OF:
    raise ValueError(f"unknown backend {name!r}; expected one of {sorted(PLATFORM_OF)}")
  return PLATFORM_OF[name]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One product `(m, K) @ (K, N)` on a platform; `itemsize`: bytes of an activation value."""

  m: int
  k: int
  n: int
  itemsize: int
  platform: str

  @classmethod
  def of(cls, m: int, k: int, n: int, dtype: Any, backend: str | None = None) -> Problem:
    """The problem of an (m, K) x (K, N) product with `dtype` activations on `backend`
    ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'; None: `jax.default_backend()`)."""
    return cls(int(m), int(k), int(n), np.dtype(dtype).itemsize, platform_of(backend))

  def describe(self) -> str:
    """'(m, K) x (K, N)', as messages name the product."""
    return f"({self.m}, {self.k}) x ({self.k}, {self.n})"


def check_operands(x: jax.Array, w: Q8Array, *, what: str = "q8_matmul") -> None:
  """Raise a clear error, naming `what`, unless x (..., K) and the Q8_0 weight (K, N) fit.

  Args:
    x: activations (..., K), float32, bfloat16 or float16.
    w: a `Q8Array` of q int8 (K, N), K a multiple of 32, blocked along axis 0, and scale
      float32 or float16 (K/32, N).
    what: the entry point the message names.

  Raises:
    TypeError: a dtype is wrong, or `w` is not a `Q8Array`.
    ValueError: a shape is wrong.
  """
  check_q8_weight(w, ndim=2, axis=0, form="2-D (K, N) blocked along axis 0", what=what)
  k = w.shape[0]
  check_activation_dtype(x, what=what)
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(
      f"{what}: activations of shape {tuple(x.shape)} do not contract with a weight of K={k} rows"
    )


def check_q8_weight(
  w: Any, *, ndim: int, axis: int, form: str, what: str, name: str = "the weight"
) -> None:
  """Raise a clear error, naming `what` and `name`, unless `w` is a `Q8Array` of rank `ndim`
  blocked along `axis` (`form` says so in the message) whose values are int8 and whose scales
  are float32 or float16 of its blocked shape (the blocked axis a whole number of 32-element
  blocks, divided by 32).

  Raises:
    TypeError: `w` is not a `Q8Array`, or its values or scales have the wrong dtype.
    ValueError: its rank, blocked axis or scales' shape is wrong.
  """
  if not isinstance(w, Q8Array):
    raise TypeError(f"{what}: {name} must be a Q8Array, got {type(w).__name__}")
  if w.ndim != ndim or w.axis != axis:
    raise ValueError(
      f"{what}: {name} must be {form}, got shape {w.shape} blocked along axis {w.axis}"
    )
  if np.dtype(w.q.dtype) != np.dtype(np.int8):
    raise TypeError(f"{what}: Q8_0 values must be int8, got {w.q.dtype}")
  if np.dtype(w.scale.dtype) not in SCALE_DTYPES:
    raise TypeError(f"{what}: Q8_0 scales must be float32 or float16, got {w.scale.dtype}")
  k = w.shape[w.axis]
  if k % BLOCK:
    raise ValueError(f"{what}: K={k} not a multiple of {BLOCK} (whole Q8_0 blocks)")
  expected = tuple(d // BLOCK if i == w.axis else d for i, d in enumerate(w.shape))
  if tuple(w.scale.shape) != expected:
    raise ValueError(
      f"{what}: scale shape {tuple(w.scale.shape)} does not match values {w.shape}"
      f" (expected {expected})"
    )


def check_activation_dtype(x: Any, *, what: str) -> None:
  """TypeError, naming `what`, unless `x`'s dtype is float32, bfloat16 or float16."""
  if np.dtype(x.dtype) not in ACTIVATION_DTYPES:
    raise TypeError(f"{what}: activations must be float32, bfloat16 or float16, got {x.dtype}")


__all__ = [
  "ACTIVATION_DTYPES",
  "PLATFORMS",
  "PLATFORM_OF",
  "SCALE_DTYPES",
  "Problem",
  "check_activation_dtype",
  "check_operands",
  "check_q8_weight",
  "platform_of",
]
