"""What one grouped Q8_0 product is: its operands (`check_ragged_operands`) and its `Problem`.

`out[m] = x[m] @ W[g(m)]` for rows x (M, K) sorted by group, `group_sizes` (E,) int32 saying how
many rows each expert gets, and E experts' Q8_0 weights W[e] = q[e] int8 (K_pad, N) * scale[e]
(K_pad/32, N), each blocked along its own K (K_pad: K rounded up to whole 32-row blocks; the
padded rows meet zero activations). `jax.lax.ragged_dot`'s contract, with a Q8_0 right side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from q8rules.kernels.problem import check_activation_dtype, check_q8_weight, platform_of
from q8rules.q8_0 import BLOCK, Q8Array


@dataclasses.dataclass(frozen=True)
class RaggedProblem:
  """One grouped product `(m, K) x E experts (K, N)` on a platform.

  Attributes:
    m: rows of x (all groups together).
    k: the weights' K (whole 32-row blocks; x is padded to it).
    n: columns.
    experts: E, the number of groups.
    itemsize: bytes of an activation value.
    platform: 'cpu', 'gpu' or 'tpu'.
  """

  m: int
  k: int
  n: int
  experts: int
  itemsize: int
  platform: str

  @classmethod
  def of(
    cls, m: int, k: int, n: int, experts: int, dtype: Any, backend: str | None = None
  ) -> RaggedProblem:
    """The problem of (m, K) rows against `experts` (K, N) weights with `dtype` activations on
    `backend` ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'; None: `jax.default_backend()`)."""
    return cls(int(m), int(k), int(n), int(experts), np.dtype(dtype).itemsize, platform_of(backend))

  def describe(self) -> str:
    """'(m, K) x 128 experts (K, N)', as messages name the product."""
    return f"({self.m}, {self.k}) x {self.experts} experts ({self.k}, {self.n})"


def _concrete(a: Any) -> np.ndarray | None:
  """`a` as a numpy array when its value is known now (not a tracer), else None."""
  if isinstance(a, jax.core.Tracer):
    return None
  try:
    return np.asarray(a)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def check_ragged_operands(
  x: Any, w: Q8Array, group_sizes: Any, *, what: str = "q8_ragged_matmul"
) -> None:
  """Raise a clear error, naming `what`, unless x, the experts' weights and the group sizes fit.

  Args:
    x: activations (M, K), float32, bfloat16 or float16, rows sorted by group.
    w: a `Q8Array` of q int8 (E, K_pad, N) blocked along axis 1 (each expert's own K) and scale
      float32 or float16 (E, K_pad/32, N); K_pad is K rounded up to a multiple of 32.
    group_sizes: (E,) integer rows per expert; when its value is known now (not traced), each
      must be >= 0 and they must sum to M.
    what: the entry point the message names.

  Raises:
    TypeError: a dtype is wrong, or `w` is not a `Q8Array`.
    ValueError: a rank, a shape or the group sizes are wrong.
  """
  check_q8_weight(
    w,
    ndim=3,
    axis=1,
    form="3-D (E, K, N) blocked along axis 1 (each expert's K)",
    what=what,
    name="the experts' weight",
  )
  e, k_pad, _ = w.shape
  check_activation_dtype(x, what=what)
  if x.ndim != 2:
    raise ValueError(f"{what}: activations must be 2-D (M, K), got shape {tuple(x.shape)}")
  m, k = x.shape
  if -(-k // BLOCK) * BLOCK != k_pad:
    raise ValueError(
      f"{what}: activations of K={k} do not contract with experts of K={k_pad} rows (K"
      f" rounded up to a multiple of {BLOCK} must equal the weight's K)"
    )
  gs = group_sizes
  if not hasattr(gs, "dtype") or not np.issubdtype(np.dtype(gs.dtype), np.integer):
    raise TypeError(
      f"{what}: group_sizes must be an integer array, got {getattr(gs, 'dtype', type(gs))}"
    )
  if tuple(gs.shape) != (e,):
    raise ValueError(
      f"{what}: group_sizes of shape {tuple(gs.shape)} for {e} experts (expected ({e},))"
    )
  values = _concrete(gs)
  if values is not None:
    if (values < 0).any():
      raise ValueError(f"{what}: group_sizes has negative sizes: {values.tolist()}")
    if int(values.sum()) != m:
      raise ValueError(
        f"{what}: group_sizes sum to {int(values.sum())}, but x has M={m} rows (each row"
        " belongs to one group, in order)"
      )


__all__ = ["RaggedProblem", "check_ragged_operands"]
