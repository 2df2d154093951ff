"""What one transposed Q8_0 product is: its operands (`check_operands_t`) and its `Problem`.

`dy (..., N) @ W^T` for a Q8_0 weight W = q int8 (K, N) * scale (K/32, N): the contraction runs
along N, across the Q8_0 blocks (which run along K). The problem keeps the weight-only
product's fields (m rows, K, N, the cotangents' itemsize, the platform), so the same sizes
judge both directions; only the message differs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels.problem import ACTIVATION_DTYPES, Problem, check_operands
from q8rules.q8_0 import Q8Array


@dataclasses.dataclass(frozen=True)
class TransposedProblem(Problem):
  """One product `(m, N) @ (K, N)^T -> (m, K)` on a platform; `itemsize`: bytes of a dy value.

  `TransposedProblem.of(m, k, n, dtype, backend)` is `Problem.of`'s, `dtype` the cotangents'."""

  def describe(self) -> str:
    """'(m, N) x (K, N)^T', as messages name the product."""
    return f"({self.m}, {self.n}) x ({self.k}, {self.n})^T"


def check_operands_t(dy: jax.Array, w: Q8Array, *, what: str = "q8_matmul_t") -> None:
  """Raise a clear error, naming `what`, unless dy (..., N) and the Q8_0 weight (K, N) fit.

  Args:
    dy: cotangents (..., N), float32, bfloat16 or float16.
    w: the Q8_0 weight (K, N), checked as `problem.check_operands` checks a product's (which
      raises as this does).
    what: the entry point the message names.

  Raises:
    TypeError, ValueError: a dtype or a shape of dy is wrong, or the weight's.
  """
  if isinstance(w, Q8Array) and w.ndim == 2:
    k = int(w.shape[0])
    check_operands(jax.ShapeDtypeStruct((1, k), jnp.float32), w, what=what)
  else:
    check_operands(jax.ShapeDtypeStruct((1,), jnp.float32), w, what=what)
  if np.dtype(dy.dtype) not in ACTIVATION_DTYPES:
    raise TypeError(f"{what}: cotangents must be float32, bfloat16 or float16, got {dy.dtype}")
  n = int(w.shape[1])
  if dy.ndim < 1 or dy.shape[-1] != n:
    raise ValueError(
      f"{what}: cotangents of shape {tuple(dy.shape)} do not contract with a weight of N={n}"
      " columns"
    )


__all__ = ["TransposedProblem", "check_operands_t"]
