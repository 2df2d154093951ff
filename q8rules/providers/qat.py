"""`Q8QatProvider`: quantization-aware training with Q8_0 fake quant.

Params stay float. A matched product runs on the weight's Q8_0 round trip,
`fake_quant(w)`, built from the serving path's own layout and quantizer, so the
served model computes with exactly the values QAT trained against. The gradient
is the straight-through estimator: the identity through the round trip (absmax
scales clip nothing, so there is no mask). `implementation` and `interpret`
choose the serving kernel and are ignored here, so one rule list serves both
providers. A non-finite weight turns its 32-block NaN (the loss goes NaN, as in
float training); `quantize_params` on such params raises, naming the param.
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

from q8rules._qwix import QuantizationProvider, is_with_aux
from q8rules.layout import ProductLayout, WeightLayout, from_dot_general
from q8rules.providers import policies, tracking
from q8rules.providers._common import (
  Product,
  RecordingProvider,
  jnp_dot_dimension_numbers,
  op_where,
)
from q8rules.providers.policies import FAKE_QUANT
from q8rules.q8_0 import BLOCK, dequantize, quantize
from q8rules.rules import Q8Rule


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
    layout.to_matrix(w), axis=0, scale_dtype=scale_dtype, name=name, check_finite=check_finite
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


class Q8QatProvider(RecordingProvider, QuantizationProvider):
  """Quantization-aware training for Q8_0 serving: fake-quantised weights, float params.

  Use as `qwix.quantize_model(model, Q8QatProvider(rules))` for linen (then
  `init`/`apply`, `jax.grad` and optimizers as usual; params stay float) and
  `qwix.quantize_model(model, Q8QatProvider(rules), *inputs)` for nnx. Works
  under `jax.jit`, `jax.checkpoint`/`nn.remat` and `nn.scan` (inside a scan the
  weight is the per-layer slice, quantized on its own). After the first run,
  `report()` lists every intercepted op (path 'fake_quant' or 'float').
  """

  def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
    # ops on weights (astype, .T, reshape, promote_dtype) and lookups (jnp.take, table[ids]):
    # q8rules.providers.tracking, decided by q8rules.providers.policies
    lookups = policies.fake_quant_lookup(self, served_round_trip), policies.refuse_q8_lookup
    return (
      super().get_intercept_map()
      | {
        "jax.lax.dot_general": self.dot_general,
        "jax.numpy.einsum": self.einsum,
        "jax.numpy.dot": self.dot,
      }
      | tracking.intercepts(lambda: self._run, *lookups)
    )

  # ---- the intercepted ops (dot_general and einsum: RecordingProvider's) -------

  def dot(
    self,
    a: jax.Array,
    b: jax.Array,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    out_sharding: Any = None,
  ) -> jax.Array:
    """`jnp.dot` with a matched weight `b` fake-quantised; matched as 'dot_general'."""

    def run(weight: Any, precision: Any) -> jax.Array:
      return jnp.dot(
        a,
        weight,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
      )

    dims = jnp_dot_dimension_numbers(a.ndim, b.ndim)
    return self._serve_op(
      "dot_general",
      a,
      b,
      lambda shape: from_dot_general(a.ndim, shape, dims),
      precision,
      preferred_element_type,
      run,
    )

  # ---- the fake quant ------------------------------------------------------

  def _serve(self, product: Product) -> jax.Array:
    """The product on the matched float weight's Q8_0 round trip, computed as serving computes
    it (in float32 at float32's precision, see `matched_precision`; the result in the
    activations' dtype or `preferred_element_type`), or the op as it is."""
    lhs = product.lhs
    fq = self._maybe_fake_quant(product.rule, product.op_id, lhs, product.rhs, product.make_layout)
    if fq is product.rhs:
      return product.run(fq, product.precision)
    dtype = jnp.result_type(lhs, fq)
    out = product.run(fq, matched_precision(product.precision, dtype, True))
    return out.astype(product.preferred_element_type or lhs.dtype)

  def _maybe_fake_quant(
    self,
    rule: Q8Rule | None,
    op_id: str,
    lhs: jax.Array,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
  ) -> Any:
    """`rhs` fake-quantised when the rule matched and it is a float weight, else `rhs`."""
    where = op_where(op_id)
    if is_with_aux(rhs):
      raise TypeError(
        f"{where}: got a Q8 (serving) weight; Q8QatProvider trains float params. Run"
        " Q8 params with the Q8Provider model, and QAT with the float params."
      )
    matched = self._match_float_weight(rule, op_id, rhs, make_layout)
    if matched is None:
      return rhs
    found, layout = matched
    scale_dtype = np.dtype(rule.scale_dtype)
    weight = layout.weight
    k, k_pad, n = weight.k, weight.k_padded, weight.n
    notes = [f"K padded {k} -> {k_pad}"] if k_pad != k else []
    if rule.implementation is not None or rule.interpret is not None:
      notes.append("implementation/interpret apply when serving")
    self._record(
      rule,
      op_id,
      FAKE_QUANT,
      weight_shape=weight.shape,
      m=math.prod(lhs.shape[a] for a in layout.lhs_free),
      k=k,
      n=n,
      float_bytes=k * n * np.dtype(rhs.dtype).itemsize,
      q8_bytes=k_pad * n + (k_pad // BLOCK) * n * scale_dtype.itemsize,
      note="; ".join(notes),
    )
    # the param's round trip, then rhs's astype / .T / reshape of it
    return policies.fake_quant_operand(
      self, found, rhs, weight, scale_dtype.name, served_round_trip
    )
