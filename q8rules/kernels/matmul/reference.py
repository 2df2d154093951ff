"""The reference Q8_0 product: dequantise the whole weight, then one dot.

Simple and slow (it materialises the float weight); the yardstick the other
implementations are tested against, as tokamax keeps a reference beside each
kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.kernels.problem import Problem
from q8rules.q8_0 import dequantize_blocks

NAME = "reference"
SUMMARY = "dequantise the whole weight, then one dot (the yardstick; slow)"
ROUNDS_WEIGHT = False
"""Every product is exact; only the float32 accumulation rounds."""


def q8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`x @ (q * scale)`: x (M, K) float, q (K, N) int8, scale (K/32, N) -> (M, N) float32.

  The operands are trusted (`q8_matmul` checks them: `problem.check_operands`)."""
  return jnp.dot(
    x.astype(jnp.float32),
    dequantize_blocks(q, scale),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def cannot(p: Problem) -> None:
  """The reference runs every problem."""
  del p


def slower(p: Problem) -> str:
  """`implementation=None` never picks the reference."""
  del p
  return "the reference is for tests"


def run(x2d: jax.Array, q: jax.Array, scale: jax.Array, platform: str, interpret: bool | None):
  """The registry's call: `q8_matmul_reference(x2d, q, scale)`, (m, N) float32."""
  del platform, interpret
  return q8_matmul_reference(x2d, q, scale)


__all__ = ["NAME", "ROUNDS_WEIGHT", "SUMMARY", "cannot", "q8_matmul_reference", "run", "slower"]
