"""`Q8QatProvider`: quantization-aware training with Q8_0 fake quant.

Params stay float. A matched product's forward pass is the served model's own: the serving
product (`Q8Provider`'s kernels, chosen by the rule's `implementation` and `interpret`) on
the param's Q8_0 values, quantized as `Q8Provider` stores them, so a QAT model's outputs are
its served model's bit for bit, in float32 and in bfloat16. Its derivatives are those of the
product on the weight's Q8_0 round trip, `fake_quant(w)`, with the straight-through
estimator: the identity through the round trip (absmax scales clip nothing, so there is no
mask). A non-finite weight turns its 32-block NaN (the loss goes NaN, as in float training);
`quantize_params` on such params raises, naming the param.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from q8rules import kernels
from q8rules._qwix import QuantizationProvider, is_with_aux
from q8rules.layout import ProductLayout, WeightLayout
from q8rules.providers import lookup, views
from q8rules.providers.mesh import run_served
from q8rules.providers.placement import param_path
from q8rules.providers.policy import (
  CurrentRule,
  PolicyProvider,
  RunOn,
  WeightPolicy,
  base_layout,
  op_where,
  stored_how,
)
from q8rules.providers.products import Product
from q8rules.providers.q8_weight import Q8Weight, quantize_weight, served_layout
from q8rules.providers.tracking import Derived
from q8rules.q8_0 import BLOCK, dequantize, quantize
from q8rules.rules import Q8Rule

FAKE_QUANT = "fake_quant"
"""The `OpRecord.path` of a fake-quantised product or lookup."""


def fake_quant(
  w: jax.Array,
  layout: WeightLayout,
  scale_dtype: Any = jnp.float32,
  *,
  name: str = "weight",
  check_finite: bool = False,
  dtype: Any = None,
) -> jax.Array:
  """The value serving computes with for the float weight `w`: its Q8_0 round trip.

  Args:
    w: float weight of `layout.shape` (float32, bfloat16 or float16).
    layout: how the weight is laid out as the (K, N) Q8_0 matrix (blocks of 32
      along K, K zero-padded to a multiple of 32).
    scale_dtype: float32 or float16, the rule's `scale_dtype`.
    name: how error messages name `w`.
    check_finite: raise on nan/inf (a host callback when traced).
    dtype: the result's dtype (None: `w`'s). float32 gives the served values exactly (`q * d`);
      a narrower dtype rounds them.

  Returns:
    `dequantize(quantize(...))` back in `w`'s shape, computed in float32 and cast
    to `dtype`. No gradient (see `fake_quant_ste`).
  """
  q = quantize(
    layout.to_matrix(w),
    axis=layout.blocked_axis,
    scale_dtype=scale_dtype,
    name=name,
    check_finite=check_finite,
  )
  if dtype is not None:
    q = dataclasses.replace(q, dtype=np.dtype(dtype))
  return layout.from_matrix(dequantize(q))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def fake_quant_ste(
  w: jax.Array, layout: WeightLayout, scale_dtype: str, dtype: str | None = None
) -> jax.Array:
  """`fake_quant(w, layout, scale_dtype, dtype=dtype)` with the straight-through gradient.

  Forward: exactly `fake_quant` (`w`'s shape; `dtype`, by default `w`'s). Derivative: the
  identity, the derivative of `w + stop_gradient(fake_quant(w) - w)` (cast to `dtype`).
  """
  return _fake_quant_jit(w, layout, scale_dtype, dtype=dtype)


# One compiled round trip per (shape, dtype, layout): op-by-op dispatch of the
# quantizer's ~60 primitives is slow outside jit (e.g. in an eager linen `init`).
_fake_quant_jit = jax.jit(
  fake_quant, static_argnums=(1, 2), static_argnames=("name", "check_finite", "dtype")
)


@fake_quant_ste.defjvp
def _fake_quant_ste_jvp(
  layout: WeightLayout,
  scale_dtype: str,
  dtype: str | None,
  primals: tuple[jax.Array],
  tangents: tuple[jax.Array],
) -> tuple[jax.Array, jax.Array]:
  (w,), (dw,) = primals, tangents
  out = _fake_quant_jit(w, layout, scale_dtype, dtype=dtype)
  return out, dw.astype(out.dtype)


def served_round_trip(w: jax.Array, layout: WeightLayout, scale_dtype: str) -> jax.Array:
  """`fake_quant_ste` in float32 (or `w`'s dtype where it is wider): the values the serving
  kernels multiply by, unrounded. They compute in float32 and round only their output, so a
  bfloat16 or float16 weight's round trip is not rounded to its dtype here either."""
  dtype = np.dtype(jnp.promote_types(w.dtype, jnp.float32)).name
  return fake_quant_ste(w, layout, scale_dtype, dtype)


def matched_precision(precision: Any, dtype: Any, matched: bool) -> Any:
  """The precision of a fake-quantised product computed in `dtype`: the op's own when it names
  one, else float32's (`Precision.HIGHEST`) in float32, so the QAT forward pass and its
  gradients compute what serving computes on every backend (a GPU's default for float32 is
  TF32), unless `jax.default_matmul_precision` says otherwise."""
  if not matched or precision is not None or dtype != jnp.float32:
    return precision
  if jax.config.jax_default_matmul_precision is not None:
    return None
  return jax.lax.Precision.HIGHEST


FakeQuantFn = Callable[[jax.Array, WeightLayout, str], jax.Array]
"""(a float value, its layout, the scale dtype) -> its Q8_0 round trip (`served_round_trip`)."""


def fake_quant_operand(
  found: Derived, base: jax.Array, view: WeightLayout, scale_dtype: str, fq: FakeQuantFn
) -> jax.Array:
  """The fake-quantised operand of a matched product whose weight is `found` (of layout `view`)
  with the param's value `base`: the param's Q8_0 round trip, then the operand's ops (what
  serving computes with)."""
  return round_trip(found, views.apply(found.chain, base), view, scale_dtype, fq, base=base)


def _narrows(found: Derived) -> bool:
  """Whether the ops cast the param to a narrower float (float32 -> bfloat16)."""
  size = np.dtype(found.base.dtype).itemsize
  for op in found.chain:
    if isinstance(op, views.AsType):
      if np.dtype(op.dtype).itemsize < size:
        return True
      size = np.dtype(op.dtype).itemsize
  return False


def round_trip(
  found: Derived,
  value: jax.Array,
  view: WeightLayout,
  scale_dtype: str,
  fq: FakeQuantFn,
  *,
  base: jax.Array | None = None,
) -> jax.Array:
  """The Q8_0 round trip of `value` = ops(param), of layout `view`, as serving computes with it.

  Transposes, reshapes and widening casts leave the values (hence the blocks) as they are, so
  the round trip of `value` itself is the served one. After a narrowing cast the served
  values come from the param's own (wider) values (`base`, by default `found.base`): the
  param's round trip, then the ops that move values (the casts left out: `fq` gives the
  values in the dtype serving computes in, and the product's result is cast as serving
  casts it). Constant factors (`w * c`) take the same road: serving multiplies the product of
  the param's own Q8_0 values.
  """
  if not _narrows(found) and not any(isinstance(op, views.FACTORS) for op in found.chain):
    return fq(value, view, scale_dtype)
  moves = tuple(op for op in found.chain if not isinstance(op, views.AsType))
  base = found.base if base is None else base
  moves, base, layout = expert_first(moves, base, base_layout(found, view))
  return views.apply(moves, fq(base, layout, scale_dtype))


def expert_first(
  chain: views.Chain, value: jax.Array, layout: WeightLayout
) -> tuple[views.Chain, jax.Array, WeightLayout]:
  """`chain` applied to `value` (of `layout`) with its `w[i]` first, when it picks one expert of
  a stack before any op but casts: (the rest of the chain, expert i's value, its layout), so
  only that expert is quantized (each expert's blocks are its own: the same values); else
  (`chain`, `value`, `layout`) as given."""
  at = next((j for j, op in enumerate(chain) if not isinstance(op, views.AsType)), None)
  if at is None or not isinstance(chain[at], views.Index):
    return chain, value, layout
  pick = chain[at]
  return chain[:at] + chain[at + 1 :], value[pick.index], pick.forward(layout)


class FakeQuantPolicy(WeightPolicy):
  """The QAT mode: params stay float; a matched product's forward is the served product on the
  param's Q8_0 values, its derivatives those of the product on the weight's Q8_0 round trip
  (`qat_product`); a matched table is fake-quantised, then looked up by the model's own op."""

  def product(self, product: Product) -> jax.Array:
    """The product on a matched float weight: forward, the serving product on the weight's
    Q8_0 values (`qat_product`); derivatives, those of the product on its Q8_0 round trip
    with the straight-through estimator. Any other op as it is."""
    lhs = product.lhs
    matched = self._matched_weight(product)
    if matched is None:
      return product.run(lhs, product.rhs, product.precision)
    found, layout, scale_dtype = matched
    self.run.weights[found.key] = scale_dtype  # a later lookup of the param is fake-quantised
    self.inventory.served.add(param_path(found.module, found.name))
    rule = forward_rule(product.rule, lhs, layout.weight)
    paths: list[str] = []
    f = qat_product(product, found, layout.weight, scale_dtype, rule, paths)
    out = f(lhs, found.base)
    notes = [f"forward: the served product ({paths[-1]})"] if paths else []
    if rule is not product.rule:
      notes.append(
        f"implementation={product.rule.implementation!r} cannot run this shape: the default"
        " implementation ran it"
      )
    self._record_fake_quant(product, layout, scale_dtype, found.base.dtype, notes)
    return out

  def _matched_weight(self, product: Product) -> tuple[Derived, ProductLayout, str] | None:
    """The param the matched float weight `product.rhs` is, the product's layout and the
    rule's scale dtype; None when the op stays float (recorded). Refuses a Q8 weight."""
    if is_with_aux(product.rhs):
      raise TypeError(
        f"{op_where(product.op_id)}: got a Q8 (serving) weight; Q8QatProvider trains float"
        " params. Run Q8 params with the Q8Provider model, and QAT with the float params."
      )
    matched = self.match_float_weight(product)
    if matched is None:
      return None
    found, layout = matched
    return found, layout, np.dtype(product.rule.scale_dtype).name

  def _record_fake_quant(
    self,
    product: Product,
    layout: ProductLayout,
    scale_dtype: str,
    dtype: Any,
    notes: list[str],
  ) -> None:
    weight = layout.weight
    k, k_pad, n = weight.k, weight.k_padded, weight.n
    experts = math.prod(weight.batch_shape)
    notes = ([f"K padded {k} -> {k_pad}"] if k_pad != k else []) + notes
    self.record(
      product.rule,
      product.op_id,
      FAKE_QUANT,
      weight_shape=weight.shape,
      m=math.prod(product.lhs.shape[a] for a in layout.lhs_free),
      k=k,
      n=n,
      float_bytes=experts * k * n * np.dtype(dtype).itemsize,
      q8_bytes=experts * (k_pad * n + (k_pad // BLOCK) * n * np.dtype(scale_dtype).itemsize),
      note="; ".join(notes),
    )

  def lookup(
    self, found: Derived, arr: jax.Array, ids: Any, axis: int, mode: Any, run_on: RunOn
  ) -> jax.Array:
    """A matched table (or one fake-quantised as a weight this run) is fake-quantised, then
    looked up by the model's own op; any other lookup runs float."""
    rule, op_id = self.current_rule(lookup.OP)
    scale_dtype = self.run.weights.get(found.key)
    if rule is not None:
      scale_dtype = np.dtype(rule.scale_dtype).name
    if scale_dtype is None:
      return self.as_float(found, rule, op_id, arr, "lookup: no rule matched", run_on)
    layout = self.lookup_layout(found, rule, op_id, arr.shape, axis)
    if layout is None:
      return run_on(arr)
    table = round_trip(found, arr, layout, scale_dtype, served_round_trip)
    self.inventory.served.add(param_path(found.module, found.name))
    note = f"lookup of {found.name}: the entries of its Q8_0 round trip"
    self.record_lookup(rule, op_id, FAKE_QUANT, layout, ids, (scale_dtype, arr.dtype), note)
    return run_on(table).astype(arr.dtype)  # as `take_q8`: the entries in the table's dtype

  def q8_lookup(self, table: Q8Weight, ids: Any, axis: int, mode: Any = None) -> jax.Array:
    """A lookup of a Q8 (serving) table: refused, as QAT's products refuse Q8 weights."""
    raise TypeError(
      f"{table.name or 'a Q8_0 table'}: got a Q8 (serving) table; Q8QatProvider trains float"
      " params. Run Q8 params with the Q8Provider model, and QAT with the float params."
    )


class Q8QatProvider(PolicyProvider, QuantizationProvider):
  """Quantization-aware training for Q8_0 serving: fake-quantised weights, float params
  (`FakeQuantPolicy`).

  Use as `qwix.quantize_model(model, Q8QatProvider(rules))` for linen (then
  `init`/`apply`, `jax.grad` and optimizers as usual; params stay float) and
  `qwix.quantize_model(model, Q8QatProvider(rules), *inputs)` for nnx. Works
  under `jax.jit`, `jax.checkpoint`/`nn.remat` and `nn.scan` (inside a scan the
  weight is the per-layer slice, quantized on its own). After the first run,
  `report()` lists every intercepted op (path 'fake_quant' or 'float').
  """

  def make_policy(self, rules: Any, current_rule: CurrentRule) -> FakeQuantPolicy:
    return FakeQuantPolicy(rules, current_rule)


def forward_rule(rule: Q8Rule, lhs: jax.Array, view: WeightLayout) -> Q8Rule:
  """The rule QAT's forward serves a product by: `rule`, unless none of its `implementation`s
  can run the product's shape (a rule naming the fold for decode shapes, on a training
  batch), then the same rule with the default implementation (the served model would refuse
  that shape; training runs it). `lhs`: the op's activation; `view`: the weight's layout."""
  if rule.implementation is None:
    return rule
  m = math.prod(lhs.shape) // max(view.k, 1)
  try:
    kernels.resolve_product(
      m,
      view.k_padded,
      view.n,
      lhs.dtype,
      implementation=rule.implementation,
      act_qtype=rule.act_qtype,
    )
  except ValueError:
    return dataclasses.replace(rule, implementation=None)
  return rule


def qat_product(
  product: Product,
  found: Derived,
  view: WeightLayout,
  scale_dtype: str,
  rule: Q8Rule,
  paths: list[str],
) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`f(lhs, param)`: the product `product` runs with its weight `found` (of layout `view`) of
  the param's value `param`, as QAT computes it; `rule` gives the forward's implementation
  (`forward_rule`).

  Forward: exactly what the served model computes, the serving product
  (`mesh.run_served`, the rule's `implementation` and `interpret`) on the param's Q8_0
  values, stored as `Q8Provider` stores them and viewed as the op's operand is, so the QAT
  model's outputs are the served model's bit for bit in every dtype. Derivative: that of the
  op on the weight's Q8_0 round trip (`fake_quant_ste`, the straight-through estimator), in
  float32 at float32's precision (`matched_precision`) for a float32 product. `paths` gets
  the implementation the forward ran (for the report).

  Returns:
    f(lhs (the op's activation), param (the param's float value)) -> the op's output in
    `product.preferred_element_type` or lhs's dtype.
  """
  where = op_where(product.op_id)
  how = stored_how(found, view, scale_dtype)
  name = param_path(found.module, found.name)
  chain, operand = found.chain, product.rhs
  out_dtype = product.preferred_element_type or product.lhs.dtype

  def fake_quant_product(lhs: jax.Array, param: jax.Array) -> jax.Array:
    fq = fake_quant_operand(found, param, view, scale_dtype, served_round_trip)
    precision = matched_precision(product.precision, jnp.result_type(lhs, fq), True)
    return product.run(lhs, fq, precision).astype(out_dtype)

  @jax.custom_jvp
  def f(lhs: jax.Array, param: jax.Array) -> jax.Array:
    rest, value, layout = expert_first(chain, param, how.layout)  # w[i]: expert i alone
    mine = dataclasses.replace(how, layout=layout)
    q8 = Q8Weight(
      array=quantize_weight(value, mine, name=name, check_finite=False), how=mine, name=name
    )
    for op in rest:
      q8 = q8.view(op)
    layout = served_layout(q8, product.make_layout, where)
    y, path = run_served(
      lhs, q8, layout, rule, operand, product.preferred_element_type, where, product.group_sizes
    )
    paths.append(path)
    return views.scale_output(y, q8.chain, layout, product.group_sizes).astype(out_dtype)

  def f_jvp(primals: tuple[Any, Any], tangents: tuple[Any, Any]) -> tuple[jax.Array, jax.Array]:
    lhs, param = primals
    y = f(lhs, param)
    live = [not isinstance(t, SymbolicZero) for t in tangents]
    if not any(live):
      return y, jnp.zeros_like(y)
    args = [p for p, on in zip(primals, live, strict=True) if on]
    dargs = [t for t, on in zip(tangents, live, strict=True) if on]

    def of_live(*xs: jax.Array) -> jax.Array:
      it = iter(xs)
      return fake_quant_product(
        *(next(it) if on else p for p, on in zip(primals, live, strict=True))
      )

    return y, jax.jvp(of_live, args, dargs)[1]

  f.defjvp(f_jvp, symbolic_zeros=True)
  return f
