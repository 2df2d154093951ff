"""One product's transformation rules, shared by the implementations that are opaque calls.

`x2d (m, K) @ (q (K, N) * scale)` is bilinear in (x, scale), so a call XLA cannot see into
(an FFI kernel, a primitive lowered per platform) gets its tangents from outside it: in x,
`matmul_t.api.linear_in_x`, a primitive linear in x whose transpose is the transposed product
(op 'matmul_t': the native kernel on the CPU for decode-sized rows, XLA's chunks elsewhere,
never the whole float weight), so the gradient with respect to x runs that op; in the scales, the XLA scan, which is
transposable. The int8 values get no tangent (a frozen base). Its vmap rule comes from the rows: a batch of x folds into them (one read of
the weight for the batch), a batched weight runs once per element.

The same rules serve a product on one layer of stacked weights (`q8rules.kernels.layer`):
extra operands after `scale` (the layer index) pass through, and `select` picks the (K, N)
weight the XLA tangents read.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from q8rules.kernels.matmul.xla_chunked import q8_matmul_xla
from q8rules.kernels.matmul_t.api import linear_in_x
from q8rules.kernels.registry import ImplementationArg

Product = Callable[..., jax.Array]
"""(x2d (m, K), q (K, N) int8, scale (K/32, N), *rest) -> (m, N) float32."""

Select = Callable[..., tuple[jax.Array, jax.Array]]
"""(q, scale, *rest) -> the (K, N) values and (K/32, N) scales the product reads."""


def _whole(q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  return q, scale


def bilinear_product(
  raw: Product, select: Select = _whole, backward: ImplementationArg = None
) -> Product:
  """`raw` with a vmap rule (batched x folds into the rows) and a jvp on `select(q, scale,
  *rest)`, the weight `raw` reads: in x through `linear_in_x`, whose transpose (the gradient
  with respect to x) is op 'matmul_t' with `implementation=backward`; in the scales through
  the XLA path."""

  @jax.custom_batching.custom_vmap
  def product(x: jax.Array, q: jax.Array, scale: jax.Array, *rest: jax.Array) -> jax.Array:
    return raw(x, q, scale, *rest)

  @product.def_vmap
  def product_vmap(axis_size, in_batched, x, q, scale, *rest):
    x_batched, *weight_batched = in_batched
    if not any(weight_batched):
      n = select(q, scale, *rest)[0].shape[1]
      if not x_batched:
        return product(x, q, scale, *rest), False
      b, m, k = x.shape
      return product(x.reshape(b * m, k), q, scale, *rest).reshape(b, m, n), True

    def batched(a: jax.Array, is_batched: bool) -> jax.Array:
      return a if is_batched else jnp.broadcast_to(a, (axis_size, *a.shape))

    args = tuple(batched(a, bt) for a, bt in zip((x, q, scale, *rest), in_batched, strict=True))
    return jax.lax.map(lambda a: product(*a), args), True

  @jax.custom_jvp
  def differentiable(x: jax.Array, q: jax.Array, scale: jax.Array, *rest: jax.Array) -> jax.Array:
    return product(x, q, scale, *rest)

  def jvp(primals, tangents):
    x, q, scale, *rest = primals
    dx, _, dscale, *_ = tangents
    y = differentiable(*primals)
    parts = []
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
      parts.append(linear_in_x(dx, *select(q, scale, *rest), backward))
    if not isinstance(dscale, jax.custom_derivatives.SymbolicZero):
      parts.append(q8_matmul_xla(x, select(q, scale, *rest)[0], select(q, dscale, *rest)[1]))
    # No zeros to add to: they would be a (m, N) residual of the forward pass.
    return y, sum(parts[1:], parts[0]) if parts else jnp.zeros_like(y)

  differentiable.defjvp(jvp, symbolic_zeros=True)
  return differentiable
