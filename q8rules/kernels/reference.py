"""The reference Q8_0 product: dequantise the whole weight, then one dot.

Simple and slow (it materialises the float weight); the yardstick the other
implementations are tested against, as tokamax keeps a reference beside each
kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from q8rules.q8_0 import BLOCK


def q8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`x @ (q * scale)`: x (M, K) float, q (K, N) int8, scale (K/32, N) -> (M, N) float32."""
  w = q.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=0)
  return jnp.dot(
    x.astype(jnp.float32),
    w,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
