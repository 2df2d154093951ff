"""The reference transposed product: dequantise the whole weight, then one dot with its
transpose (the yardstick; it builds the float weight, which no other implementation does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels.matmul_t.problem import TransposedProblem
from q8rules.q8_0 import BLOCK, dequantize_blocks

NAME = "reference"
SUMMARY = "dequantise the whole weight, then one dot with its transpose (the yardstick; slow)"


def q8_matmul_t_reference(dy: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`dy @ (q * scale)^T`: dy (M, N) float, q (K, N) int8, scale (K/32, N) -> (M, K) float32,
  at `Precision.HIGHEST`."""
  return jnp.dot(
    dy.astype(jnp.float32),
    dequantize_blocks(q, scale).T,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def reference_float64(dy: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """The product in numpy float64 (for tests): (M, N) float, (K, N) int8, (K/32, N) ->
  (M, K) float64."""
  w = np.asarray(q, np.float64) * np.repeat(np.asarray(scale, np.float64), BLOCK, axis=0)
  return np.asarray(dy, np.float64) @ w.T


def cannot(p: TransposedProblem) -> None:
  """The reference runs every problem."""
  del p


def slower(p: TransposedProblem) -> str:
  """`implementation=None` never picks the reference."""
  del p
  return "the reference is for tests"


def run(dy2d: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """The registry's call: `q8_matmul_t_reference(dy2d, q, scale)`, (m, K) float32."""
  return q8_matmul_t_reference(dy2d, q, scale)


__all__ = [
  "NAME",
  "SUMMARY",
  "cannot",
  "q8_matmul_t_reference",
  "reference_float64",
  "run",
  "slower",
]
