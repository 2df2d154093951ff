"""`Q8Provider`: serve matched Dense/Einsum weights as Q8_0 through Qwix's interception.

Built on `qwix.PtqProvider`, which intercepts the products and Flax's param
creation. A matched weight becomes a 2-D `Q8Array` (K, N) (`q8rules.layout`;
K zero-padded to a multiple of 32, which is exact) held as `WithAux(Q8Array,
Q8How)`, and its product runs through `q8rules.q8_matmul` (whichever
implementation `kernels.resolve` picks: the Pallas fold, the native CPU kernel
or the chunked XLA path), never through a float copy of the weight. Every
intercepted op is recorded for `report()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from q8rules import kernels
from q8rules._qwix import (
  PLUMBING_INTERCEPTIONS,
  PtqProvider,
  WithAux,
  current_rule_and_op_id,
  find_param,
  get_attribute,
  get_value_from_path,
  unbox,
)
from q8rules.kernels.layer import LayerSlice
from q8rules.layout import (
  ProductLayout,
  Q8How,
  UnsupportedProduct,
)
from q8rules.providers import model_hooks, policies, tracking
from q8rules.providers._common import Product, RecordingProvider, op_where
from q8rules.providers.mesh import provider_product
from q8rules.providers.views import conform
from q8rules.q8_0 import BLOCK, Q8Array, checked_finite, quantize
from q8rules.rules import Q8Rule
from q8rules.tree_paths import listing, path_str


def quantize_weight(
  w: jax.Array, how: Q8How, *, name: str = "weight", check_finite: bool = True
) -> Q8Array:
  """The float weight (how.layout.shape) as a (K_padded, N) Q8Array, blocked along axis 0.

  `check_finite=False` where the caller has already checked `w` (see `quantize`)."""
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"{name}: cannot quantize a weight of dtype {w.dtype} to Q8_0 (not float)")
  if tuple(w.shape) != how.layout.shape:
    raise ValueError(
      f"{name}: weight of shape {tuple(w.shape)} does not match its Q8 params, which"
      f" were made for shape {how.layout.shape}"
    )
  return dataclasses.replace(
    quantize(
      how.layout.to_matrix(w),
      axis=0,
      scale_dtype=how.scale_dtype,
      name=name,
      check_finite=check_finite,
    ),
    dtype=np.dtype(how.dtype),
  )


def _quantize_param(value: jax.Array, how: Q8How, name: str) -> Q8Array:
  """How a provider run quantizes a param (`q8rules.providers.placement.install`)."""
  return quantize_weight(value, how, name=name)


def _shapes_only(value: jax.Array, how: Q8How, name: str) -> Q8Array:
  """What `_quantize_param` returns, in shapes and dtypes only (zeros; nothing traced but
  two fills): q (K_padded, N) int8, scale (K_padded/32, N) of how.scale_dtype."""
  del value, name
  k, n = how.layout.k_padded, how.layout.n
  return Q8Array(
    jnp.zeros((k, n), jnp.int8),
    jnp.zeros((k // BLOCK, n), how.scale_dtype),
    axis=0,
    dtype=np.dtype(how.dtype),
  )


class Q8Provider(RecordingProvider, PtqProvider):
  """Serve weights of ops matched by `Q8Rule`s as Q8_0.

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

  _quantize: Callable[[jax.Array, Q8How, str], Q8Array] = staticmethod(_quantize_param)

  @contextlib.contextmanager
  def shapes_only(self) -> Iterator[None]:
    """Within it, an `init` makes each Q8 param as zeros of the right shapes and dtypes instead
    of quantizing the float init: for `jax.eval_shape(model.init, ...)` (the param tree's
    shapes), which then does not trace the Q8_0 quantizer once per weight."""
    self._quantize = _shapes_only
    try:
      yield
    finally:
      del self._quantize

  def _quantize_now(self, value: jax.Array, how: Q8How, name: str) -> Q8Array:
    """The param quantizer in force (`_quantize_param`, or zeros under `shapes_only`)."""
    return self._quantize(value, how, name)

  def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
    """Qwix's PTQ interceptions, with every op this provider does not serve (convolutions:
    `jax.lax.conv_general_dilated`) run float and recorded (path 'float', with a note)."""
    intercepts = super().get_intercept_map()
    for name in intercepts:
      if name not in self.SERVED | self.PLUMBING:
        intercepts[name] = self._float_op(name)
    # ops on weights (astype, .T, reshape, promote_dtype) and lookups (jnp.take, table[ids]):
    # q8rules.providers.tracking, decided by q8rules.providers.policies
    lookups = policies.serve_lookup(self, self._quantize_now), policies.q8_lookup(self)
    return intercepts | tracking.intercepts(lambda: self._run, *lookups) | model_hooks.intercepts()

  def _float_op(self, name: str) -> Callable[..., Any]:
    """The op at `name` (e.g. 'jax.lax.conv_general_dilated'), run as it is, in float."""
    op = name.rsplit(".", 1)[-1]

    def run(*args: Any, **kwargs: Any) -> Any:
      rule, op_id = current_rule_and_op_id(self, op)
      weight = args[1] if len(args) > 1 else None
      shape = tuple(weight.shape) if weight is not None and find_param(weight) else None
      self._record(
        rule,
        op_id,
        "float",
        weight_shape=shape,
        note=f"{op} is not served as Q8_0 (only dot_general/einsum products are): left float",
      )
      # Inside a handler Qwix's interception is off: this runs the original op.
      return get_attribute(name)(*args, **kwargs)

    return run

  # ---- the intercepted ops (dot_general, einsum: RecordingProvider's; jnp.dot: Qwix's,
  # through dot_general) ------------------------------------------------------

  def asarray(self, a, dtype=None, order=None, **kwargs):
    """Intercepts jnp.asarray so a Q8 weight passes through unchanged."""
    unboxed = unbox(a)
    if isinstance(unboxed, WithAux) and isinstance(unboxed.how, Q8How):
      return unboxed
    if isinstance(unboxed, Q8Array):
      return unboxed
    return super().asarray(a, dtype=dtype, order=order, **kwargs)

  # ---- the product ---------------------------------------------------------

  def _serve(self, product: Product) -> jax.Array:
    """The op as a Q8_0 product when its operand is a Q8 weight or a float weight the rule
    matched (per shard when a mesh splits the weight), else as it is; recorded either way."""
    rule, op_id, lhs, rhs = product.rule, product.op_id, product.lhs, product.rhs
    preferred_element_type = product.preferred_element_type
    served = self._served_weight(rule, op_id, rhs, product.make_layout)
    if served is None:
      return product.run(lhs, rhs, product.precision)
    q8, layout = served
    how, weight = q8.how, q8.array
    y, path = run_served(lhs, q8, layout, rule, rhs, preferred_element_type, op_where(op_id))
    m = math.prod(lhs.shape[a] for a in layout.lhs_free)
    k, k_pad, n = layout.weight.k, layout.weight.k_padded, layout.weight.n
    self._record(
      rule,
      op_id,
      path,
      weight_shape=layout.weight.shape,
      m=int(m),
      k=k,
      n=n,
      float_bytes=k * n * np.dtype(how.dtype).itemsize,
      q8_bytes=weight.nbytes,
      note=policies.weight_note(q8, k, k_pad),
    )
    y = self._adapted(product, q8, layout, y)
    return y.astype(preferred_element_type or lhs.dtype)

  def _adapted(
    self, product: Product, q8: WithAux, layout: ProductLayout, y: jax.Array
  ) -> jax.Array:
    """The served product's result `y` (float32, the op's output shape) as the model gets it,
    before the cast to the op's dtype: `y` itself here; a LoRA provider adds its delta."""
    del product, q8, layout
    return y

  def _served_weight(
    self,
    rule: Q8Rule | None,
    op_id: str,
    rhs: Any,
    make_layout: Callable[[tuple[int, ...]], ProductLayout],
  ) -> tuple[WithAux, ProductLayout] | None:
    """The Q8 weight a product runs on (and the product's layout, conformed to the weight's):
    `rhs` itself when it is one (its layout checked against the product's), else the param of
    the matched float weight `rhs` (also through astype / .T / reshape) stored as Q8_0 and
    viewed as `rhs` is; None when the op stays float."""
    where = op_where(op_id)
    if not (isinstance(rhs, WithAux) and isinstance(rhs.how, Q8How)):  # a float operand
      matched = self._match_float_weight(rule, op_id, rhs, make_layout)
      if not matched:
        return None
      # its param stored as Q8_0 (sharding annotation carried over), served as rhs's view of it
      rhs = policies.serve_operand(self, rule, matched[0], matched[1].weight, self._quantize_now)
    return rhs, served_layout(rhs, make_layout, where)


def served_layout(
  q8: WithAux, make_layout: Callable[[tuple[int, ...]], ProductLayout], where: str
) -> ProductLayout:
  """The layout of a product on the Q8 weight `q8`, conformed to how the weight is laid out
  (`make_layout`: the weight's shape -> the op's layout). Raises ValueError, naming the op,
  when the weight cannot serve the product."""
  how, weight = q8.how, q8.array
  try:
    layout = conform(make_layout(how.layout.shape), how.layout)
  except UnsupportedProduct as e:
    raise ValueError(f"{where}: Q8 weight used by a product it cannot serve: {e}") from e
  if layout is None:
    raise ValueError(
      f"{where}: the Q8 weight was laid out as {how.layout} but this product needs"
      f" {make_layout(how.layout.shape).weight}"
    )
  k_pad, n = layout.weight.k_padded, layout.weight.n
  if tuple(weight.shape) != (k_pad, n):
    raise ValueError(
      f"{where}: Q8 values of shape {tuple(weight.shape)} do not match the weight"
      f" layout ({k_pad}, {n})"
    )
  return layout


def run_served(
  lhs: jax.Array,
  q8: WithAux,
  layout: ProductLayout,
  rule: Q8Rule | None,
  operand: Any,
  preferred_element_type: Any,
  where: str,
) -> tuple[jax.Array, str]:
  """`lhs` times the Q8 weight `q8` (laid out for this product as `layout`) as serving runs
  it: per shard where a mesh splits the weight (`provider_product`), else whole through
  `kernels.run_product` with the rule's `implementation` and `interpret`.

  Args:
    lhs: the activation as the op got it (any rank; float32, bfloat16 or float16).
    q8: the Q8 weight (a `Q8Weight` or Qwix `WithAux(Q8Array (K_padded, N), Q8How)`).
    layout: the product's layout, conformed to the weight's (`Q8Provider._served_weight`).
    rule: the matched rule (None: the defaults).
    operand: the op's own weight operand (how a mesh plan finds its param).
    preferred_element_type: the op's own.
    where: how errors name the op ('module/path/op_id').

  Returns:
    (y in the op's output shape, accumulated in float32: in lhs's dtype when split over a mesh,
    else in `preferred_element_type` or lhs's; the caller casts it to the op's dtype; the path
    it took).
  """
  weight = q8.array
  options = {
    "implementation": rule.implementation if rule is not None else None,
    "interpret": rule.interpret if rule is not None else None,
    "act_qtype": rule.act_qtype if rule is not None else None,
  }
  try:
    layout.check_lhs(tuple(lhs.shape))
    # split over a mesh (`q8rules.shard_products`, or explicit sharding): per shard, on the
    # layer's own arrays (a `LayerSlice` is read in place only unsplit; unused, XLA drops
    # the slice)
    whole = weight.take() if isinstance(weight, LayerSlice) else weight
    ran = provider_product(lhs, whole, layout, operand=operand, **options)
    if ran is None:
      y2d, path = kernels.run_product(
        layout.lhs_matrix(lhs), weight, preferred_element_type=preferred_element_type, **options
      )
      ran = layout.output(y2d, tuple(lhs.shape)), path
  except (TypeError, ValueError, NotImplementedError) as e:
    raise type(e)(f"{where}: {e}") from e
  return ran


def _quantize_stacked(w: jax.Array, how: Q8How, name: str, *, check_finite: bool) -> Q8Array:
  """`quantize_weight`, vmapped over leading axes that a lifted transform (`nn.scan`,
  `nn.vmap`) stacked the per-layer weight along: (*L, *how.layout.shape) -> Q8Array
  of q (*L, K_padded, N), as the Q8 model's own init makes it."""

  def f(a: jax.Array) -> Q8Array:
    return quantize_weight(a, how, name=name, check_finite=check_finite)

  extra = w.ndim - len(how.layout.shape)
  if extra > 0 and tuple(w.shape[extra:]) == how.layout.shape:
    for _ in range(extra):
      f = jax.vmap(f)
  return f(w)


def _param_paths(abstract_quantized_params: Any) -> set[tuple[Any, ...]]:
  """The paths of every param leaf of the Q8 model (a Q8 weight counts as one leaf)."""
  if isinstance(abstract_quantized_params, nnx.Module):
    paths = set()
    for path, node in nnx.iter_graph(abstract_quantized_params):
      if isinstance(node, nnx.Param):
        # nnx keeps a WithAux's parts as Params at .../kernel/array/{q,scale}
        if len(path) > 2 and path[-2] == "array" and path[-1] in ("q", "scale"):
          path = path[:-2]
        paths.add(tuple(path))
    return paths
  if isinstance(abstract_quantized_params, nnx.State):
    abstract_quantized_params = nnx.to_pure_dict(abstract_quantized_params)
  return set(flax.traverse_util.flatten_dict(abstract_quantized_params))


def _as_dict(params: Any) -> Any:
  """A float param tree as nested dicts of arrays: an nnx.State (or a dict holding nnx
  Variables) becomes its pure dict."""
  if isinstance(params, nnx.State):
    return nnx.to_pure_dict(params)
  return jax.tree.map(
    lambda v: v[...] if isinstance(v, nnx.Variable) else v,
    params,
    is_leaf=lambda v: isinstance(v, nnx.Variable),
  )


def _names(paths: Any) -> str:
  """Param paths (tuples of keys), sorted, as an indented listing."""
  return listing(sorted(path_str(p) for p in paths))


def quantize_params(
  params: Any,
  abstract_quantized_params: Any,
  *,
  allow_extra_params: bool = False,
) -> Any:
  """Float checkpoint params in, Q8 params out, without running the model.

  Like `qwix.quantize_params`.

  Args:
    params: the float param tree (linen: unboxed `variables['params']`; nnx:
      `nnx.state(model)` or `nnx.state(model, nnx.Param)`, as an `nnx.State` or
      its pure dict).
    abstract_quantized_params: the param tree of the Q8 model (linen: from
      `init`, possibly under `jax.eval_shape`), or the Q8 nnx model itself.
    allow_extra_params: skip float params the Q8 model does not have.

  Returns:
    The param tree with every weight the Q8 model serves as Q8_0 replaced by
    `WithAux(Q8Array, Q8How)`, other leaves as given (nnx: a pure dict, for
    `nnx.update(q8_model, ...)`).

  Raises:
    ValueError: a param of the Q8 model that `params` lacks (naming every one,
      and every float param the model does not have), or a float param the Q8
      model does not have (unless `allow_extra_params`).
  """
  flat = flax.traverse_util.flatten_dict(_as_dict(params))
  found = {path: get_value_from_path(abstract_quantized_params, path) for path in flat}
  extra = [path for path, v in found.items() if v is None]
  missing = _param_paths(abstract_quantized_params) - set(flat)
  if missing or (extra and not allow_extra_params):
    problems = []
    if missing:
      problems.append(
        f"the float params lack {len(missing)} param(s) of the quantized model:\n{_names(missing)}"
      )
    if extra:
      problems.append(
        f"{len(extra)} float param(s) are not in the quantized model's params:\n{_names(extra)}"
      )
    raise ValueError("quantize_params: " + "\n".join(problems))
  quantized = {}
  for path, param in flat.items():
    abs_param = found[path]
    if abs_param is None:
      continue
    abs_param = unbox(abs_param)
    if isinstance(abs_param, WithAux) and isinstance(abs_param.how, Q8How):
      name = path_str(path)
      param = jnp.asarray(param)
      traced = isinstance(param, jax.core.Tracer)
      if not traced:  # checked once, here: a clear ValueError, not a run-time callback per layer
        checked_finite(param, name)
      q8 = _quantize_stacked(param, abs_param.how, name, check_finite=traced)
      param = abs_param.replace(array=q8)
    quantized[path] = param
  if isinstance(abstract_quantized_params, nnx.Module):
    quantized = nnx.to_pure_dict(nnx.state(quantized))
  return flax.traverse_util.unflatten_dict(quantized)
