"""Serving: matched Dense/Einsum weights as Q8_0, through Qwix's interception.

`ServePolicy` is the serving mode's `WeightPolicy`: a matched weight becomes a 2-D `Q8Array`
(K, N) (`q8rules.layout`; K zero-padded to a multiple of 32, which is exact) held as
`WithAux(Q8Array, Q8How)`, and its product runs through the kernels
(`mesh.run_served`: whichever implementation `kernels.resolve` picks, the Pallas fold, the
native CPU kernel or the chunked XLA path), never through a float copy of the weight. A lookup
of a matched table reads the looked-up columns of its Q8_0 values. Every intercepted op is
recorded for `report()`. `Q8Provider` is the Qwix provider (built on `qwix.PtqProvider`, which
intercepts the products and Flax's param creation) that runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from q8rules._qwix import (
  PLUMBING_INTERCEPTIONS,
  PtqProvider,
  WithAux,
  find_param,
  get_attribute,
  module_params,
  unbox,
)
from q8rules.layout import ProductLayout, Q8How, WeightLayout
from q8rules.providers import lookup, q8_weight, views
from q8rules.providers.mesh import run_served
from q8rules.providers.placement import install, param_path
from q8rules.providers.policy import (
  CurrentRule,
  PolicyProvider,
  RunOn,
  WeightPolicy,
  op_where,
  stored_how,
  weight_note,
)
from q8rules.providers.products import Product
from q8rules.providers.q8_weight import Q8Weight, as_q8_weight, quantize_weight, served_layout
from q8rules.providers.tracking import Derived
from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.rules import Q8Rule

Quantizer = Callable[[jax.Array, Q8How, str], Q8Array]
"""(the float param's value, how to store it, its name) -> its Q8_0 values."""


def _quantize_param(value: jax.Array, how: Q8How, name: str) -> Q8Array:
  """How a provider run quantizes a param (`q8rules.providers.placement.install`)."""
  return quantize_weight(value, how, name=name)


def _shapes_only(value: jax.Array, how: Q8How, name: str) -> Q8Array:
  """What `_quantize_param` returns, in shapes and dtypes only (zeros; nothing traced but
  two fills): q (*E, K_padded, N) int8, scale (*E, K_padded/32, N) of how.scale_dtype."""
  del value, name
  *experts, k, n = how.layout.stored_shape
  return Q8Array(
    jnp.zeros((*experts, k, n), jnp.int8),
    jnp.zeros((*experts, k // BLOCK, n), how.scale_dtype),
    axis=how.layout.blocked_axis,
    dtype=np.dtype(how.dtype),
  )


class ServePolicy(WeightPolicy):
  """The serving mode: a matched float weight is stored as Q8_0 (once; later runs find it
  stored) and served from its Q8_0 values; a Q8 weight is served as it is.

  Attributes:
    quantizer: how a param is stored (`_quantize_param`; zeros under `Q8Provider.shapes_only`).
  """

  def __init__(self, rules: Any, current_rule: CurrentRule):
    super().__init__(rules, current_rule)
    self.quantizer: Quantizer = _quantize_param

  # ---- products ------------------------------------------------------------

  def product(self, product: Product) -> jax.Array:
    """The op as a Q8_0 product when its operand is a Q8 weight or a float weight the rule
    matched (per shard when a mesh splits the weight), else as it is; recorded either way."""
    rule, op_id, lhs, rhs = product.rule, product.op_id, product.lhs, product.rhs
    preferred_element_type = product.preferred_element_type
    served = self.served_weight(product)
    if served is None:
      return product.run(lhs, rhs, product.precision)
    q8, layout = served
    how, weight = q8.how, q8.array
    where = op_where(op_id)
    y, path = run_served(
      lhs, q8, layout, rule, rhs, preferred_element_type, where, product.group_sizes
    )
    m = math.prod(lhs.shape[a] for a in layout.lhs_free)
    k, k_pad, n = layout.weight.k, layout.weight.k_padded, layout.weight.n
    self.record(
      rule,
      op_id,
      path,
      weight_shape=layout.weight.shape,
      m=int(m),
      k=k,
      n=n,
      float_bytes=math.prod(layout.weight.batch_shape) * k * n * np.dtype(how.dtype).itemsize,
      q8_bytes=weight.nbytes,
      note=weight_note(q8, k, k_pad),
    )
    y = self.adapted(product, q8, layout, y)
    if isinstance(q8, Q8Weight):  # the constant factors the model put on the weight
      y = views.scale_output(y, q8.chain, layout, product.group_sizes)
    return y.astype(preferred_element_type or lhs.dtype)

  def adapted(
    self, product: Product, q8: WithAux, layout: ProductLayout, y: jax.Array
  ) -> jax.Array:
    """The served product's result `y` (float32, the op's output shape) as the model gets it,
    before the cast to the op's dtype: `y` itself here; a LoRA policy adds its delta."""
    del product, q8, layout
    return y

  def served_weight(self, product: Product) -> tuple[WithAux, ProductLayout] | None:
    """The Q8 weight a product runs on (and the product's layout, conformed to the weight's):
    its operand itself when it is one (its layout checked against the product's), else the
    param of the matched float weight (also through astype / .T / reshape) stored as Q8_0 and
    viewed as the operand is; None when the op stays float."""
    rhs = product.rhs
    if not (isinstance(rhs, WithAux) and isinstance(rhs.how, Q8How)):  # a float operand
      matched = self.match_float_weight(product)
      if not matched:
        return None
      found, layout = matched
      # its param stored as Q8_0 (sharding annotation carried over), served as rhs's view of it
      rhs = self.stored(found, layout.weight, product.rule)
    return rhs, served_layout(rhs, product.make_layout, op_where(product.op_id))

  def stored(self, found: Derived, view: WeightLayout, rule: Q8Rule | None) -> Q8Weight:
    """The param of `found` stored as Q8_0 (now, or earlier this run), as the view `found` is
    (of layout `view`)."""
    box = module_params(found.module)[found.name]
    weight = as_q8_weight(box)
    if weight is None:
      if rule is None:
        raise ValueError(f"{found.name}: no rule for a weight that is not stored as Q8_0")
      how = stored_how(found, view, np.dtype(rule.scale_dtype).name)
      weight = install(found.module, found.name, found.base, how, self.quantizer)
      # the model still holds the float value it read (a tied table's head after its lookup)
      base = found.base
      self.run.derived.setdefault(id(base), (dataclasses.replace(found, chain=(), shapes=()), base))
    self.run.weights[found.key] = weight.how.scale_dtype
    self.inventory.served.add(param_path(found.module, found.name))
    for op in found.chain:
      weight = weight.view(op)
    return weight

  # ---- lookups -------------------------------------------------------------

  def lookup(
    self, found: Derived, arr: jax.Array, ids: Any, axis: int, mode: Any, run_on: RunOn
  ) -> jax.Array:
    """A matched table is stored as Q8_0 and looked up from its Q8_0 values; with no rule, or a
    float table given to a linen `apply`, the lookup runs float."""
    rule, op_id = self.current_rule(lookup.OP)
    given_float = isinstance(found.module, nn.Module) and not found.module.is_initializing()
    if rule is None or given_float:
      note = "lookup: no rule matched" if rule is None else "lookup: the table was given float"
      return self.as_float(found, rule, op_id, arr, note, run_on)
    layout = self.lookup_layout(found, rule, op_id, arr.shape, axis)
    if layout is None:
      return run_on(arr)
    table = self.stored(found, layout, rule)
    return self._looked_up(rule, op_id, table, ids, axis, mode)

  def q8_lookup(self, table: Q8Weight, ids: Any, axis: int, mode: Any = None) -> jax.Array:
    """A lookup of a stored Q8 table (any rule): gathered from its Q8_0 values, recorded."""
    rule, op_id = self.current_rule(lookup.OP)
    return self._looked_up(rule, op_id, table, ids, axis, mode)

  def _looked_up(
    self, rule: Q8Rule | None, op_id: str, table: Q8Weight, ids: Any, axis: int, mode: Any
  ) -> jax.Array:
    out = q8_weight.lookup(table, ids, axis, mode)
    dtypes = (table.array.scale.dtype, table.dtype)
    note = f"lookup of {table.name or 'the table'}: the entries' Q8_0 values, dequantised"
    self.record_lookup(rule, op_id, lookup.PATH, table.how.layout, ids, dtypes, note)
    return out


class Q8Provider(PolicyProvider, PtqProvider):
  """Serve weights of ops matched by `Q8Rule`s as Q8_0 (`ServePolicy`).

  Use as `qwix.quantize_model(model, Q8Provider(rules))` for linen (then
  `init`/`apply` as usual: `init` creates Q8 params directly), and
  `qwix.quantize_model(model, Q8Provider(rules), *inputs)` for nnx.
  After the first run, `report()` lists every intercepted op.
  """

  SERVED = frozenset(
    {
      "jax.lax.dot_general",
      "jax.numpy.dot",
      "jax.numpy.einsum",
      "jax.numpy.asarray",
    }
  )
  """The Qwix interceptions this provider serves (jnp.dot goes through dot_general)."""

  PLUMBING = PLUMBING_INTERCEPTIONS
  """Qwix interceptions that are not products: kept as `qwix.PtqProvider` has them."""

  policy: ServePolicy

  def make_policy(self, rules: Any, current_rule: CurrentRule) -> ServePolicy:
    return ServePolicy(rules, current_rule)

  @contextlib.contextmanager
  def shapes_only(self) -> Iterator[None]:
    """Within it, an `init` makes each Q8 param as zeros of the right shapes and dtypes instead
    of quantizing the float init: for `jax.eval_shape(model.init, ...)` (the param tree's
    shapes), which then does not trace the Q8_0 quantizer once per weight."""
    self.policy.quantizer = _shapes_only
    try:
      yield
    finally:
      self.policy.quantizer = _quantize_param

  def base_intercepts(self) -> dict[str, Callable[..., Any]]:
    """Qwix's PTQ interceptions, with every op this provider does not serve (convolutions:
    `jax.lax.conv_general_dilated`) run float and recorded (path 'float', with a note)."""
    intercepts = super().base_intercepts()
    for name in intercepts:
      if name not in self.SERVED | self.PLUMBING:
        intercepts[name] = self._float_op(name)
    return intercepts

  def _float_op(self, name: str) -> Callable[..., Any]:
    """The op at `name` (e.g. 'jax.lax.conv_general_dilated'), run as it is, in float."""
    op = name.rsplit(".", 1)[-1]

    def run(*args: Any, **kwargs: Any) -> Any:
      rule, op_id = self.current_rule(op)
      weight = args[1] if len(args) > 1 else None
      shape = tuple(weight.shape) if weight is not None and find_param(weight) else None
      self.policy.record(
        rule,
        op_id,
        "float",
        weight_shape=shape,
        note=f"{op} is not served as Q8_0 (only dot_general/einsum products are): left float",
      )
      # Inside a handler Qwix's interception is off: this runs the original op.
      return get_attribute(name)(*args, **kwargs)

    return run

  def dot(self, *args: Any, **kwargs: Any) -> jax.Array:
    """`jnp.dot` as `qwix.PtqProvider` runs it: through this provider's `dot_general`."""
    return PtqProvider.dot(self, *args, **kwargs)

  def asarray(self, a, dtype=None, order=None, **kwargs):
    """Intercepts jnp.asarray so a Q8 weight passes through unchanged."""
    unboxed = unbox(a)
    if isinstance(unboxed, WithAux) and isinstance(unboxed.how, Q8How):
      return unboxed
    if isinstance(unboxed, Q8Array):
      return unboxed
    return super().asarray(a, dtype=dtype, order=order, **kwargs)


__all__ = ["Q8Provider", "Quantizer", "ServePolicy", "quantize_weight"]
