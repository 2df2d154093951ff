"""The weight-only Q8_0 product, op 'matmul': `q8_matmul`, `run_product` and their primitives.

`x (..., K) @ W` for a Q8_0 weight W = q int8 (K, N) * scale (K/32, N), accumulated in float32.
The implementations, one module each: `fold` (the Pallas fold, over `pallas_mosaic_tpu` and
`pallas_triton`), 'cpu' (the native kernel, `kernels/native/`), `xla_chunked` ('xla'),
`xla_dequant` and `reference`. `kernels.registry.resolve` picks one, at trace time for the
default backend (what the report shows) and again when the product is lowered, per platform
(`q8_product_p`), so one `jax.export` artifact runs the right kernel on CPU, GPU and TPU. With
`act_qtype='q8_0'` the product is op 'matmul_act_q8' (`kernels/matmul_act_q8/`), chosen the
same way. Operands are checked once, here (`check_operands`, from `problem`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from q8rules.kernels import lowering, registry
from q8rules.kernels.layer import LayerSlice, check_stacked
from q8rules.kernels.matmul import cpu, fold, reference, xla_chunked, xla_dequant
from q8rules.kernels.matmul._bilinear import bilinear_product
from q8rules.kernels.matmul_act_q8 import api as act
from q8rules.kernels.matmul_t.api import backward_implementation
from q8rules.kernels.problem import Problem, check_operands, platform_of
from q8rules.kernels.registry import ImplementationArg
from q8rules.q8_0 import Q8Array

MODULES = (fold, cpu, xla_chunked, xla_dequant, reference)
"""The implementation modules, each with `NAME`, `SUMMARY`, `ROUNDS_WEIGHT`, `cannot`, `slower`
and `run(x2d, q, scale, platform, interpret)` -> (m, N) float32."""

DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("fold", "xla_dequant", "xla"),
  "tpu": ("fold", "xla_dequant", "xla"),
}
"""What `implementation=None` tries, in order, per platform; the last always applies. On GPU
and TPU the fold takes decode shapes and the dequantise-then-dot the rest (provisional until
measured on the devices: docs/design.md, "GPU dispatch")."""

OP = registry.register(registry.Op.of("matmul", MODULES, DEFAULT_ORDER, fallback="xla"))
"""The op: its implementations and default order."""

REGISTRY = OP.implementations
"""Every implementation of the weight-only product, by name."""

IMPLEMENTATIONS = OP.names


def check_implementation(
  implementation: ImplementationArg, *, what: str = "implementation"
) -> None:
  """Raise a clear error unless `implementation` is None, a name of the weight-only product's
  implementations, or a sequence of them."""
  registry.check_implementation(implementation, OP, what=what)


def why_not(
  name: str, m: int, k: int, n: int, dtype: Any = jnp.bfloat16, backend: str | None = None
) -> str | None:
  """Why implementation `name` cannot run an (m, K) x (K, N) product on `backend` (None: it can)."""
  return registry.why_not(OP, name, Problem.of(m, k, n, dtype, backend))


def resolve_product(
  m: int,
  k: int,
  n: int,
  dtype: Any = jnp.bfloat16,
  backend: str | None = None,
  implementation: ImplementationArg = None,
  act_qtype: str | None = None,
) -> str:
  """The implementation that runs an (m, K) x (K, N) product with `dtype` activations:
  `registry.resolve` of op 'matmul' (or, with `act_qtype='q8_0'`, 'matmul_act_q8') on
  `Problem.of(m, k, n, dtype, backend)`.

  Args:
    m, k, n: rows of activations, contraction size, columns.
    dtype: the activations' dtype (its size enters the fold's bytes rule).
    backend: 'cpu', 'gpu' ('cuda', 'rocm'), 'tpu', or None for `jax.default_backend()`.
    implementation: None, a name, or a sequence of names (`registry.resolve`).
    act_qtype: None (weight-only), or 'q8_0': the activations quantized too.

  Raises:
    ValueError: no named implementation can run the product; the message gives each one's
      reason.
  """
  act.check_act_qtype(act_qtype)
  op = OP if act_qtype is None else act.OP
  return registry.resolve(op, Problem.of(m, k, n, dtype, backend), implementation)


# ---- the product, dispatched when it is lowered ----------------------------------------


def _run_on(
  platform: str, x2d, q, scale, *, implementation, interpret, act_qtype=None
) -> jax.Array:
  """The product as `platform` runs it: (m, K) @ (K, N) -> (m, N) float32."""
  m, k = x2d.shape
  name = resolve_product(m, k, q.shape[1], x2d.dtype, platform, implementation, act_qtype)
  if act_qtype is not None:
    return act.OP.implementations[name].run(x2d, q, scale)
  return REGISTRY[name].run(x2d, q, scale, platform, interpret)


q8_product_p = lowering.float32_primitive(
  "q8_product", lambda x2d, q, scale: (x2d.shape[0], q.shape[1]), _run_on
)
"""x2d (m, K), q (K, N) int8, scale (K/32, N) -> (m, N) float32; lowered per platform by
`resolve`, so the kernel is chosen for the platform the program is compiled for."""


def _run_layer_on(
  platform: str, x2d, q, scale, layer, *, implementation, interpret, act_qtype=None
) -> jax.Array:
  """The product on layer `layer` of stacked q (L, K, N), scale (L, K/32, N) as `platform` runs
  it: the native CPU kernel reads the layer in place; every other implementation gets the
  layer sliced out first (`LayerSlice.take`)."""
  m, k = x2d.shape
  name = resolve_product(m, k, q.shape[2], x2d.dtype, platform, implementation, act_qtype)
  if act_qtype is not None:
    return act.OP.implementations[name].run(x2d, q, scale, layer)
  if (run_layer := REGISTRY[name].run_layer) is not None:
    return run_layer(x2d, q, scale, layer)
  w = LayerSlice(Q8Array(q, scale), layer).take()
  return REGISTRY[name].run(x2d, w.q, w.scale, platform, interpret)


q8_layer_product_p = lowering.float32_primitive(
  "q8_layer_product", lambda x2d, q, scale, layer: (x2d.shape[0], q.shape[2]), _run_layer_on
)
"""x2d (m, K), q (L, K, N) int8, scale (L, K/32, N), layer () int32 -> (m, N) float32: the
product on one layer of stacked weights, lowered per platform like `q8_product_p`."""


def _select_layer(q: jax.Array, scale: jax.Array, layer: jax.Array):
  w = LayerSlice(Q8Array(q, scale), layer).take()
  return w.q, w.scale


@functools.cache
def _product(
  implementation: ImplementationArg,
  interpret: bool | None,
  stacked: bool = False,
  act_qtype: str | None = None,
):
  """The product for one (implementation, interpret, act_qtype): the primitive with its vmap
  and jvp (with Q8_0 activations, the weight-only product's: straight through their rounding).
  The gradient with respect to x runs op 'matmul_t' (`backward_implementation`)."""
  params = {"implementation": implementation, "interpret": interpret, "act_qtype": act_qtype}
  backward = backward_implementation(implementation)

  if stacked:

    def bind_layer(x2d, q, scale, layer):
      return q8_layer_product_p.bind(x2d, q, scale, layer, **params)

    return bilinear_product(bind_layer, _select_layer, backward)

  def bind(x2d, q, scale):
    return q8_product_p.bind(x2d, q, scale, **params)

  return bilinear_product(bind, backward=backward)


def run_product(
  x: jax.Array,
  w: Q8Array | LayerSlice,
  *,
  implementation: ImplementationArg = None,
  interpret: bool | None = None,
  preferred_element_type: Any = None,
  act_qtype: str | None = None,
) -> tuple[jax.Array, str]:
  """`q8_matmul`, and the name of the implementation it chose for the default backend
  (with Q8_0 activations, followed by ' (act q8_0)', e.g. 'cpu (act q8_0)').

  The name is what `resolve` picks at trace time (the one choice callers such as
  the report should show); lowering for another platform picks that platform's own.
  `w` may be a `LayerSlice` (one layer of stacked weights, read in place where the chosen
  implementation can: `q8rules.kernels.layer`).
  """
  if isinstance(w, LayerSlice):
    check_stacked(w)
    check_operands(x, w.spec())
  else:
    check_operands(x, w)
  k, n = w.shape
  x2d = x.reshape(-1, k)
  chosen = resolve_product(x2d.shape[0], k, n, x.dtype, None, implementation, act_qtype)
  ran = chosen if act_qtype is None else f"{chosen} (act {act_qtype})"
  impl = (
    implementation
    if implementation is None or isinstance(implementation, str)
    else tuple(implementation)
  )
  if x2d.shape[0] == 0 or n == 0:
    y = jnp.zeros((x2d.shape[0], n), jnp.float32)
  elif isinstance(w, LayerSlice):
    y = _product(impl, interpret, True, act_qtype)(x2d, w.stacked.q, w.stacked.scale, w.layer)
  else:
    y = _product(impl, interpret, False, act_qtype)(x2d, w.q, w.scale)
  return y.reshape(*x.shape[:-1], n).astype(preferred_element_type or x.dtype), ran


def q8_matmul(
  x: jax.Array,
  w: Q8Array,
  *,
  implementation: ImplementationArg = None,
  interpret: bool | None = None,
  preferred_element_type: Any = None,
  act_qtype: str | None = None,
) -> jax.Array:
  """`y = x @ W` for x (..., K) float32/bfloat16/float16 and W a (K, N) Q8Array.

  Accumulates in float32 and returns (..., N) in `preferred_element_type`
  (default: x's dtype). `implementation` as `resolve`; it is checked now for the
  default backend (a clear error at trace time) and resolved again per platform
  when the program is lowered. `interpret` runs the fold in Pallas interpret
  mode (None: on CPU only). `act_qtype='q8_0'` quantizes x to Q8_0 too, as llama.cpp does
  (opt-in: `q8rules.kernels.matmul_act_q8`). `run_product` also returns the implementation's name.
  """
  y, _ = run_product(
    x,
    w,
    implementation=implementation,
    interpret=interpret,
    preferred_element_type=preferred_element_type,
    act_qtype=act_qtype,
  )
  return y


__all__ = [
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "MODULES",
  "OP",
  "REGISTRY",
  "check_implementation",
  "platform_of",
  "q8_layer_product_p",
  "q8_matmul",
  "q8_product_p",
  "resolve_product",
  "run_product",
  "why_not",
]
