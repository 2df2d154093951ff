"""The products a provider intercepts, each as a `Product`: `lax.dot_general`, `jnp.dot`,
`jnp.einsum` of two operands and `jax.lax.ragged_dot` (a grouped product of experts).

`ProductIntercepts` is mixed into a provider: each handler builds the op's `Product` (its layout
as a function of the weight's shape, and the op itself to run in float) and hands it to the
provider's policy. Adding a product-shaped op is one handler here and one entry in
`product_intercepts` (docs/design.md, "Adding an op").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.layout import (
  ProductLayout,
  UnsupportedProduct,
  from_dot_general,
  from_einsum,
  from_ragged_dot,
)
from q8rules.rules import Q8Rule


@dataclasses.dataclass(frozen=True)
class Product:
  """One intercepted two-operand product, `lhs` times the (weight) operand `rhs`.

  Attributes:
    rule, op_id: the matched rule (None: none) and the op's id, e.g. 'dot_general0'.
    lhs: the activation as the op got it (any rank).
    rhs: the other operand as the op got it (a float param, a Qwix `WithAux`, or an array).
    make_layout: the weight's shape -> the product's layout (raises `UnsupportedProduct`).
    precision, preferred_element_type: the op's own.
    run: `run(lhs, weight, precision)`, the op itself on `lhs` with `weight` for `rhs` (in
      float); it closes over no array, so it can run on other operands (a tangent).
    group_sizes: a grouped product's (`jax.lax.ragged_dot`) rows per expert, (G,) int32;
      None for a plain product.
  """

  rule: Q8Rule | None
  op_id: str
  lhs: jax.Array
  rhs: Any
  make_layout: Callable[[tuple[int, ...]], ProductLayout]
  precision: Any
  preferred_element_type: Any
  run: Callable[[Any, Any, Any], jax.Array]
  group_sizes: jax.Array | None = None


class ProductPolicy(Protocol):
  """What the handlers need of a policy (`q8rules.providers.policy.WeightPolicy`)."""

  def product(self, product: Product) -> jax.Array:
    """The intercepted product's output, recorded."""
    ...

  def record(self, rule: Q8Rule | None, op_id: str, path: str, **fields: Any) -> None:
    """Put the op being intercepted in the report."""
    ...


class ProductIntercepts:
  """The product handlers of a provider whose `policy` serves them (see the module)."""

  policy: ProductPolicy

  def current_rule(self, op: str) -> tuple[Q8Rule | None, str]:
    """The rule matching the op being intercepted (op name `op`) and its op id."""
    raise NotImplementedError(f"{type(self).__name__} does not define current_rule")

  def product_intercepts(self) -> dict[str, Callable[..., Any]]:
    """Qwix name -> the handler of each product this provider intercepts."""
    return {
      "jax.lax.dot_general": self.dot_general,
      "jax.numpy.einsum": self.einsum,
      "jax.numpy.dot": self.dot,
      "jax.lax.ragged_dot": self.ragged_dot,
    }

  def dot_general(
    self,
    lhs: jax.Array,
    rhs: Any,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    *,
    out_sharding: Any = None,
  ) -> jax.Array:
    """`lax.dot_general(lhs, rhs, ...)` as the policy serves it."""

    run = _op(
      jax.lax.dot_general,
      dimension_numbers,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      return from_dot_general(lhs.ndim, shape, dimension_numbers)

    return self._product(
      "dot_general", lhs, rhs, make_layout, precision, preferred_element_type, run
    )

  def dot(
    self,
    a: jax.Array,
    b: Any,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    out_sharding: Any = None,
  ) -> jax.Array:
    """`jnp.dot(a, b)` as the policy serves it; its rules name it 'dot_general'."""

    run = _op(jnp.dot, preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    dims = jnp_dot_dimension_numbers(np.ndim(a), len(b.shape))

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      return from_dot_general(np.ndim(a), shape, dims)

    return self._product("dot_general", a, b, make_layout, precision, preferred_element_type, run)

  def einsum(
    self,
    einsum_str: str,
    *operands: Any,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    _dot_general: Callable[..., jax.Array] = jax.lax.dot_general,  # noqa: N803 (jnp's name)
    out_sharding: Any = None,
  ) -> jax.Array:
    """`jnp.einsum` of two operands (the second the weight) as the policy serves it; of other
    counts, in float (recorded)."""

    def run(*ops: Any, precision: Any = precision) -> jax.Array:
      return jnp.einsum(
        einsum_str,
        *ops,
        precision=precision,
        preferred_element_type=preferred_element_type,
        _dot_general=_dot_general,
        out_sharding=out_sharding,
      )

    if len(operands) != 2:
      rule, op_id = self.current_rule("einsum")
      self.policy.record(rule, op_id, "float", note=f"{len(operands)}-operand einsum")
      return run(*operands)
    lhs, rhs = operands

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      return from_einsum(einsum_str, lhs.ndim, shape)

    return self._product(
      "einsum",
      lhs,
      rhs,
      make_layout,
      precision,
      preferred_element_type,
      lambda lhs, weight, precision: run(lhs, weight, precision=precision),
    )

  def ragged_dot(
    self,
    lhs: jax.Array,
    rhs: Any,
    group_sizes: jax.Array,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    group_offset: jax.Array | None = None,
  ) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)`, experts `rhs` (G, K, N), as the policy
    serves it (a grouped product; its rules name it 'ragged_dot')."""

    run = _op(
      jax.lax.ragged_dot,
      group_sizes,
      preferred_element_type=preferred_element_type,
      group_offset=group_offset,
    )

    def make_layout(shape: tuple[int, ...]) -> ProductLayout:
      if group_offset is not None:
        raise UnsupportedProduct("ragged_dot with a group_offset")
      return from_ragged_dot(tuple(lhs.shape), shape)

    rule, op_id = self.current_rule("ragged_dot")
    return self.policy.product(
      Product(
        rule, op_id, lhs, rhs, make_layout, precision, preferred_element_type, run, group_sizes
      )
    )

  def _product(
    self,
    op: str,
    lhs: jax.Array,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
    precision: Any,
    preferred_element_type: Any,
    run: Callable[[Any, Any, Any], jax.Array],
  ) -> jax.Array:
    """The policy's answer to the product the op `op` ('dot_general', 'einsum': how rules name
    it) runs."""
    rule, op_id = self.current_rule(op)
    return self.policy.product(
      Product(rule, op_id, lhs, rhs, make_layout, precision, preferred_element_type, run)
    )


def _op(
  op: Callable[..., jax.Array], *rest: Any, **options: Any
) -> Callable[[Any, Any, Any], jax.Array]:
  """`run(lhs, weight, precision)`: the op itself, `op(lhs, weight, *rest, precision=precision,
  **options)` (a `Product`'s `run`; it closes over no array but the op's own operands)."""

  def run(lhs: Any, weight: Any, precision: Any) -> jax.Array:
    return op(lhs, weight, *rest, precision=precision, **options)

  return run


def jnp_dot_dimension_numbers(a_ndim: int, b_ndim: int) -> jax.lax.DotDimensionNumbers:
  """The `lax.dot_general` dimension numbers of `jnp.dot(a, b)`."""
  if a_ndim == 0 or b_ndim == 0:
    contract = ((), ())
  elif b_ndim == 1:
    contract = ((a_ndim - 1,), (0,))
  else:
    contract = ((a_ndim - 1,), (b_ndim - 2,))
  return (contract, ((), ()))


__all__ = ["Product", "ProductIntercepts", "ProductPolicy", "jnp_dot_dimension_numbers"]
