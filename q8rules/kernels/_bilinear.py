"""One product's transformation rules, shared by the implementations that are opaque calls.

`x2d (m, K) @ (q (K, N) * scale)` is bilinear in (x, scale), so a call XLA cannot see into
(an FFI kernel, a primitive lowered per platform) gets its tangents from the XLA path, which
is transposable, and its vmap rule from the rows: a batch of x folds into them (one read of
the weight for the batch), a batched weight runs once per element.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from q8rules.kernels.xla_chunked import q8_matmul_xla

Product = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
"""(x2d (m, K), q (K, N) int8, scale (K/32, N)) -> (m, N) float32."""


def bilinear_product(raw: Product) -> Product:
  """`raw` with a vmap rule (batched x folds into the rows) and a jvp through the XLA path."""

  @jax.custom_batching.custom_vmap
  def product(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    return raw(x, q, scale)

  @product.def_vmap
  def product_vmap(axis_size, in_batched, x, q, scale):
    x_batched, q_batched, scale_batched = in_batched
    if not (q_batched or scale_batched):
      if not x_batched:
        return product(x, q, scale), False
      b, m, k = x.shape
      return product(x.reshape(b * m, k), q, scale).reshape(b, m, q.shape[1]), True

    def batched(a: jax.Array, is_batched: bool) -> jax.Array:
      return a if is_batched else jnp.broadcast_to(a, (axis_size, *a.shape))

    args = (batched(x, x_batched), batched(q, q_batched), batched(scale, scale_batched))
    return jax.lax.map(lambda a: product(*a), args), True

  @jax.custom_jvp
  def differentiable(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    return product(x, q, scale)

  def jvp(primals, tangents):
    x, q, scale = primals
    dx, _, dscale = tangents
    y = differentiable(x, q, scale)
    dy = jnp.zeros_like(y)
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
      dy = dy + q8_matmul_xla(dx, q, scale)
    if not isinstance(dscale, jax.custom_derivatives.SymbolicZero):
      dy = dy + q8_matmul_xla(x, q, dscale)
    return y, dy

  differentiable.defjvp(jvp, symbolic_zeros=True)
  return differentiable
