"""The reference grouped Q8_0 product: every expert dequantised in turn, every row multiplied by
it, each row keeping its own expert's product.

Simple and slow (E times the rows' work; one expert's float weight at a time); the yardstick the
other implementations are tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.ragged_matmul.groups import row_groups
from q8rules.kernels.ragged_matmul.problem import RaggedProblem
from q8rules.q8_0 import dequantize_blocks

NAME = "reference"
SUMMARY = "each expert dequantised in turn against every row, rows masked (the yardstick; slow)"

_HIGHEST = jax.lax.Precision.HIGHEST


def ragged_reference(
  x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array
) -> jax.Array:
  """`out[m] = x[m] @ (q[g(m)] * scale[g(m)])`, (M, N) float32, for x (M, K) float32, bfloat16
  or float16 (exactly float32), q (E, K, N) int8, scale (E, K/32, N) float32 or float16 and
  group_sizes (E,) int32 rows per expert in order (rows past their sum get zeros)."""
  m = x.shape[0]
  experts, _, n = q.shape
  x = x.astype(jnp.float32)
  groups = row_groups(group_sizes, m)[:, None]

  def expert(e, out):
    w = dequantize_blocks(q[e], scale[e])
    y = jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=jnp.float32)
    return jnp.where(groups == e, y, out)

  return jax.lax.fori_loop(0, experts, expert, jnp.zeros((m, n), jnp.float32))


def ragged_reference_t(
  dy: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array
) -> jax.Array:
  """The transposed product `dx[m] = dy[m] @ W[g(m)]^T`, (M, K) float32 (the gradient in x)."""
  m = dy.shape[0]
  experts, k, _ = q.shape
  dy = dy.astype(jnp.float32)
  groups = row_groups(group_sizes, m)[:, None]

  def expert(e, out):
    w = dequantize_blocks(q[e], scale[e])
    y = jnp.dot(dy, w.T, precision=_HIGHEST, preferred_element_type=jnp.float32)
    return jnp.where(groups == e, y, out)

  return jax.lax.fori_loop(0, experts, expert, jnp.zeros((m, k), jnp.float32))


def cannot(p: RaggedProblem) -> None:
  """The reference runs every problem."""
  del p


def slower(p: RaggedProblem) -> str:
  """`implementation=None` never picks the reference."""
  del p
  return "the reference is for tests"


def run(x2d, q, scale, group_sizes, platform: str, interpret: bool | None) -> jax.Array:
  """The registry's call: `ragged_reference(x2d, q, scale, group_sizes)`, (m, N) float32."""
  del platform, interpret
  return ragged_reference(x2d, q, scale, group_sizes)


__all__ = ["NAME", "SUMMARY", "cannot", "ragged_reference", "ragged_reference_t", "run", "slower"]
