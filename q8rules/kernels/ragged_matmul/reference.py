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


def _grouped(
  a: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, transposed: bool
) -> jax.Array:
  """`out[m] = a[m] @ W[g(m)]`, or `a[m] @ W[g(m)]^T` when `transposed`: (M, N) or (M, K)
  float32, every expert against every row, each row keeping its own expert's."""
  m = a.shape[0]
  experts, k, n = q.shape
  a = a.astype(jnp.float32)
  groups = row_groups(group_sizes, m)[:, None]

  def expert(e, out):
    w = dequantize_blocks(q[e], scale[e])
    w = w.T if transposed else w
    y = jnp.dot(a, w, precision=_HIGHEST, preferred_element_type=jnp.float32)
    return jnp.where(groups == e, y, out)

  return jax.lax.fori_loop(0, experts, expert, jnp.zeros((m, k if transposed else n), jnp.float32))


def ragged_reference(
  x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array
) -> jax.Array:
  """`out[m] = x[m] @ (q[g(m)] * scale[g(m)])`, (M, N) float32, for x (M, K) float32, bfloat16
  or float16 (exactly float32), q (E, K, N) int8, scale (E, K/32, N) float32 or float16 and
  group_sizes (E,) int32 rows per expert in order (rows past their sum get zeros)."""
  return _grouped(x, q, scale, group_sizes, transposed=False)


def ragged_reference_t(
  dy: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array
) -> jax.Array:
  """The transposed product `dx[m] = dy[m] @ W[g(m)]^T`, (M, K) float32 (the gradient in x)."""
  return _grouped(dy, q, scale, group_sizes, transposed=True)


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
