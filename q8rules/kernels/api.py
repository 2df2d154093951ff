"""The one place that decides which Q8_0 product implementation runs, and `q8_matmul`.

A registry of implementations (tokamax's model), one module each (`MODULES`): each says
where it cannot run (`cannot`), where `implementation=None` passes it over for a faster
one (`slower`), and runs the product on checked operands (`run`). `resolve` is the only
function that picks; `q8_matmul`, the per-shard product, `Q8Rule` validation and the
report all call it. Operands are checked once, here (`check_operands`, from `problem`).
The choice is made again when the product is lowered, per platform (`q8_product_p`), so
one `jax.export` artifact runs the right kernel on CPU, GPU and TPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from q8rules.kernels import act_q8_0, cpu_native, fold, reference, xla_chunked, xla_dequant
from q8rules.kernels._bilinear import bilinear_product
from q8rules.kernels.cpu_native import CPU_MAX_ROWS
from q8rules.kernels.layer import LayerSlice, check_stacked
from q8rules.kernels.problem import (
  ACTIVATION_DTYPES,
  PLATFORM_OF,
  PLATFORMS,
  Problem,
  check_operands,
  platform_of,
)
from q8rules.q8_0 import Q8Array

_LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

ImplementationArg = str | Sequence[str] | None
"""`implementation=`: None (the best for the platform and shape), a name, or names tried in order."""


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to compute `x2d (m, K) @ (q (K, N) int8 * scale (K/32, N))` -> (m, N) float32:
  an implementation module's `NAME`, `SUMMARY`, `cannot`, `slower`, `run` and `ROUNDS_WEIGHT`.

  Attributes:
    name: what `implementation=` calls it.
    summary: one line for docs and errors.
    cannot: why it cannot run a problem (None: it can).
    slower: why `implementation=None` passes it over for the next one (None: pick it).
    run: `run(x2d, q, scale, platform, interpret)` -> (m, N) float32, on checked operands.
    rounds_weight: True when bf16/f16 activations meet the weight rounded to their dtype
      (the product within that dtype's accuracy of float64); False when every product
      is exact and only float32 accumulation rounds.
  """

  name: str
  summary: str
  cannot: Callable[[Problem], str | None]
  slower: Callable[[Problem], str | None]
  run: Callable[[jax.Array, jax.Array, jax.Array, str, bool | None], jax.Array]
  rounds_weight: bool = False

  @classmethod
  def of(cls, module: ModuleType) -> Implementation:
    """The implementation an implementation module defines."""
    return cls(
      module.NAME, module.SUMMARY, module.cannot, module.slower, module.run, module.ROUNDS_WEIGHT
    )


MODULES = (fold, cpu_native, xla_chunked, xla_dequant, reference)
"""The implementation modules, each with `NAME`, `SUMMARY`, `ROUNDS_WEIGHT`, `cannot`, `slower`
and `run`."""

REGISTRY: dict[str, Implementation] = {m.NAME: Implementation.of(m) for m in MODULES}
"""Every implementation, by name."""

IMPLEMENTATIONS = tuple(REGISTRY)

DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("fold", "xla_dequant", "xla"),
  "tpu": ("fold", "xla_dequant", "xla"),
}
"""What `implementation=None` tries, in order, per platform; the last always applies. On GPU
and TPU the fold takes decode shapes and the dequantise-then-dot the rest (provisional until
measured on the devices: docs/design.md, "GPU dispatch")."""


ACT_DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("xla",),
  "tpu": ("xla",),
}
"""What `implementation=None` tries for the Q8_0 x Q8_0 product (`act_qtype='q8_0'`,
`act_q8_0.IMPLEMENTATIONS`), per platform; the last always runs."""


def _pick(
  p: Problem,
  implementation: ImplementationArg,
  order: tuple[str, ...],
  cannot: Callable[[str, Problem], str | None],
  slower: Callable[[str, Problem], str | None],
  product: str,
) -> str:
  """`resolve`'s one choice: with `implementation=None` the first of `order` that can run `p`
  and is not slower (else the last); otherwise the first named one that can run it, or a
  ValueError giving each one's reason (`product`: how the message names the product)."""
  if implementation is None:
    for name in order:
      if cannot(name, p) is None and slower(name, p) is None:
        return name
    return order[-1]
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  reasons = []
  for name in names:
    reason = cannot(name, p)
    if reason is None:
      return name
    reasons.append(f"{name!r}: {reason}")
  raise ValueError(
    f"implementation={implementation!r} cannot run {product}({p.m}, {p.k}) x ({p.k}, {p.n}) on"
    f" {p.platform}: {'; '.join(reasons)}; use 'xla', which runs every shape"
  )


def check_implementation(
  implementation: ImplementationArg, *, what: str = "implementation"
) -> None:
  """Raise a clear error unless `implementation` is None, a registered name, or a sequence of them."""
  if implementation is None:
    return
  names = (implementation,) if isinstance(implementation, str) else implementation
  if isinstance(names, Sequence) and names and all(isinstance(n, str) for n in names):
    unknown = [n for n in names if n not in REGISTRY]
    if not unknown:
      return
  raise ValueError(
    f"{what}={implementation!r}: expected None, one of {IMPLEMENTATIONS}, or a sequence of them"
  )


def why_not(
  name: str, m: int, k: int, n: int, dtype: Any = jnp.bfloat16, backend: str | None = None
) -> str | None:
  """Why implementation `name` cannot run an (m, K) x (K, N) product on `backend` (None: it can)."""
  check_implementation(name)
  p = Problem.of(m, k, n, dtype, backend)
  return REGISTRY[name].cannot(p)


def resolve(
  m: int,
  k: int,
  n: int,
  dtype: Any = jnp.bfloat16,
  backend: str | None = None,
  implementation: ImplementationArg = None,
  act_qtype: str | None = None,
) -> str:
  """The implementation that runs an (m, K) x (K, N) product with `dtype` activations.

  Args:
    m, k, n: rows of activations, contraction size, columns.
    dtype: the activations' dtype (its size enters the fold's bytes rule).
    backend: 'cpu', 'gpu' ('cuda', 'rocm'), 'tpu', or None for `jax.default_backend()`.
    implementation: None (the first of `DEFAULT_ORDER[platform]` that can run
      the product and is not slower than the next), a name (it must be able to
      run the product), or a sequence of names (the first that can).
    act_qtype: None (weight-only), or 'q8_0': the activations quantized too, whose
      implementations are `act_q8_0.IMPLEMENTATIONS` ('cpu', 'xla'; `ACT_DEFAULT_ORDER`).

  Raises:
    ValueError: no named implementation can run the product; the message gives
      each one's reason.
  """
  check_implementation(implementation)
  act_q8_0.check_act_qtype(act_qtype)
  p = Problem.of(m, k, n, dtype, backend)
  if act_qtype is not None:
    return _pick(
      p,
      implementation,
      ACT_DEFAULT_ORDER[p.platform],
      act_q8_0.cannot,
      act_q8_0.slower,
      "the act_qtype='q8_0' product ",
    )
  return _pick(
    p,
    implementation,
    DEFAULT_ORDER[p.platform],
    lambda name, p: REGISTRY[name].cannot(p),
    lambda name, p: REGISTRY[name].slower(p),
    "",
  )


# ---- the product, dispatched when it is lowered ----------------------------------------


def _run_on(
  platform: str, x2d, q, scale, *, implementation, interpret, act_qtype=None
) -> jax.Array:
  """The product as `platform` runs it: (m, K) @ (K, N) -> (m, N) float32."""
  m, k = x2d.shape
  name = resolve(m, k, q.shape[1], x2d.dtype, platform, implementation, act_qtype)
  if act_qtype is not None:
    return act_q8_0.run(name, x2d, q, scale)
  return REGISTRY[name].run(x2d, q, scale, platform, interpret)


q8_product_p = Primitive("q8_product")
"""x2d (m, K), q (K, N) int8, scale (K/32, N) -> (m, N) float32; lowered per platform by
`resolve`, so the kernel is chosen for the platform the program is compiled for."""


@q8_product_p.def_abstract_eval
def _abstract_eval(x2d, q, scale, **params):
  del scale, params
  return jax.core.ShapedArray((x2d.shape[0], q.shape[1]), jnp.float32)


@q8_product_p.def_impl
def _impl(x2d, q, scale, **params):
  return _run_on(platform_of(), x2d, q, scale, **params)


for _lp in _LOWERING_PLATFORMS:
  mlir.register_lowering(
    q8_product_p,
    mlir.lower_fun(functools.partial(_run_on, PLATFORM_OF[_lp]), multiple_results=False),
    platform=_lp,
  )


def _run_layer_on(
  platform: str, x2d, q, scale, layer, *, implementation, interpret, act_qtype=None
) -> jax.Array:
  """The product on layer `layer` of stacked q (L, K, N), scale (L, K/32, N) as `platform` runs
  it: the native CPU kernel reads the layer in place; every other implementation gets the
  layer sliced out first (`LayerSlice.take`)."""
  m, k = x2d.shape
  name = resolve(m, k, q.shape[2], x2d.dtype, platform, implementation, act_qtype)
  if act_qtype is not None:
    return act_q8_0.run(name, x2d, q, scale, layer)
  if name == cpu_native.NAME:
    return cpu_native.q8_matmul_cpu_layer(x2d, q, scale, layer)
  w = LayerSlice(Q8Array(q, scale), layer).take()
  return REGISTRY[name].run(x2d, w.q, w.scale, platform, interpret)


q8_layer_product_p = Primitive("q8_layer_product")
"""x2d (m, K), q (L, K, N) int8, scale (L, K/32, N), layer () int32 -> (m, N) float32: the
product on one layer of stacked weights, lowered per platform like `q8_product_p`."""


@q8_layer_product_p.def_abstract_eval
def _layer_abstract_eval(x2d, q, scale, layer, **params):
  del scale, layer, params
  return jax.core.ShapedArray((x2d.shape[0], q.shape[2]), jnp.float32)


@q8_layer_product_p.def_impl
def _layer_impl(x2d, q, scale, layer, **params):
  return _run_layer_on(platform_of(), x2d, q, scale, layer, **params)


for _lp in _LOWERING_PLATFORMS:
  mlir.register_lowering(
    q8_layer_product_p,
    mlir.lower_fun(functools.partial(_run_layer_on, PLATFORM_OF[_lp]), multiple_results=False),
    platform=_lp,
  )


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
  and jvp (with Q8_0 activations, the weight-only product's: straight through their rounding)."""
  params = {"implementation": implementation, "interpret": interpret, "act_qtype": act_qtype}

  if stacked:

    def bind_layer(x2d, q, scale, layer):
      return q8_layer_product_p.bind(x2d, q, scale, layer, **params)

    return bilinear_product(bind_layer, _select_layer)

  def bind(x2d, q, scale):
    return q8_product_p.bind(x2d, q, scale, **params)

  return bilinear_product(bind)


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
  chosen = resolve(x2d.shape[0], k, n, x.dtype, None, implementation, act_qtype)
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
  (opt-in: `q8rules.kernels.act_q8_0`). `run_product` also returns the implementation's name.
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
  "ACTIVATION_DTYPES",
  "ACT_DEFAULT_ORDER",
  "CPU_MAX_ROWS",
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "MODULES",
  "PLATFORMS",
  "REGISTRY",
  "Implementation",
  "ImplementationArg",
  "LayerSlice",
  "Problem",
  "check_implementation",
  "check_operands",
  "platform_of",
  "q8_layer_product_p",
  "q8_matmul",
  "q8_product_p",
  "resolve",
  "run_product",
  "why_not",
]
