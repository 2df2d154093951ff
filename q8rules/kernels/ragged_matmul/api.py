"""The grouped (ragged) Q8_0 product, op 'ragged_matmul': `q8_ragged_matmul` and its primitive.

`out[m] = x[m] @ W[g(m)]`, `jax.lax.ragged_dot`'s contract (tokamax's `ragged_dot` too) with E
experts' Q8_0 weights: rows of x (M, K) sorted by group, `group_sizes` (E,) rows per expert,
W[e] = q[e] int8 (K_pad, N) * scale[e] (K_pad/32, N), each blocked along its own K; accumulated
in float32. The implementations, one module each: 'pallas' (Mosaic TPU, Triton GPU; interpret
mode on CPU), 'cpu' (the native kernel), 'xla' and 'reference'. `kernels.registry.resolve`
picks one at trace time for the default backend and again when the product is lowered, per
platform (`q8_ragged_product_p`), so one `jax.export` artifact runs each platform's kernel.

With `act_qtype='q8_0'` the activations are quantized to Q8_0 first, as llama.cpp multiplies
its Q8_0 experts (`kernels.matmul_act_q8`'s numerics): the native kernel's int8 block dots where
the CPU has AVX-512 VNNI, else the chosen implementation on the activations' Q8_0 round trip
(the same product to float32 rounding).

The gradient with respect to x is the transposed grouped product dx[m] = dy[m] @ W[g(m)]^T
(a loop over the routed experts in XLA, or the reference's when `implementation='reference'`),
and the scales' is XLA's too; the int8 values and the group sizes get none. With Q8_0
activations the gradients are the weight-only product's (a straight-through estimator on the
activations' rounding).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from q8rules.kernels import lowering, registry
from q8rules.kernels.layer import LayerSlice
from q8rules.kernels.matmul_act_q8 import api as act_q8
from q8rules.kernels.matmul_act_q8.reference import round_trip
from q8rules.kernels.ragged_matmul import cpu, pallas, reference, xla
from q8rules.kernels.ragged_matmul.problem import RaggedProblem, check_ragged_operands
from q8rules.kernels.registry import ImplementationArg
from q8rules.q8_0 import Q8Array

MODULES = (pallas, cpu, xla, reference)
"""The implementation modules, each with `NAME`, `SUMMARY`, `cannot`, `slower` and
`run(x2d, q, scale, group_sizes, platform, interpret)` -> (m, N) float32."""

DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("pallas", "xla"),
  "tpu": ("pallas", "xla"),
}
"""What `implementation=None` tries, in order, per platform; the last always applies. The
Pallas kernels on GPU and TPU are chosen for every shape until measured on the devices."""

OP = registry.register(registry.Op.of("ragged_matmul", MODULES, DEFAULT_ORDER, fallback="xla"))
"""The op: its implementations and default order."""

IMPLEMENTATIONS = OP.names
"""The grouped product's implementations."""


def resolve_ragged(
  m: int,
  k: int,
  n: int,
  experts: int,
  dtype: Any = jnp.bfloat16,
  backend: str | None = None,
  implementation: ImplementationArg = None,
) -> str:
  """The implementation that runs (m, K) rows against `experts` (K, N) Q8_0 weights with `dtype`
  activations on `backend` (None: the default backend): `registry.resolve` of this op."""
  problem = RaggedProblem.of(m, k, n, experts, dtype, backend)
  return registry.resolve(OP, problem, implementation)


def _run_on(platform: str, x2d, q, scale, group_sizes, *, implementation, interpret, act_qtype):
  """The product as `platform` runs it: (m, K) rows against (E, K, N) -> (m, N) float32; with
  `act_qtype='q8_0'` on Q8_0 activations (the native int8 kernel, else the round trip)."""
  experts, k, n = q.shape
  name = resolve_ragged(x2d.shape[0], k, n, experts, x2d.dtype, platform, implementation)
  if act_qtype is not None:
    if name == cpu.NAME:
      return cpu.ragged_cpu(x2d, q, scale, group_sizes, act_q8=True)
    x2d = round_trip(x2d)
  return OP.implementations[name].run(x2d, q, scale, group_sizes, platform, interpret)


q8_ragged_product_p = lowering.float32_primitive(
  "q8_ragged_product", lambda x2d, q, scale, group_sizes: (x2d.shape[0], q.shape[2]), _run_on
)
"""x2d (m, K), q (E, K, N) int8, scale (E, K/32, N), group_sizes (E,) int32 -> (m, N) float32;
lowered per platform by `resolve`."""


def _batch(args, dims, **params):
  """A batch of grouped products runs one after another (`lax.map`)."""
  size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

  def batched(a, d):
    return jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)

  xs = tuple(batched(a, d) for a, d in zip(args, dims, strict=True))
  return jax.lax.map(lambda t: q8_ragged_product_p.bind(*t, **params), xs), 0


batching.primitive_batchers[q8_ragged_product_p] = _batch


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _product(x2d, q, scale, group_sizes, implementation, interpret, act_qtype):
  return q8_ragged_product_p.bind(
    x2d,
    q,
    scale,
    group_sizes,
    implementation=implementation,
    interpret=interpret,
    act_qtype=act_qtype,
  )


def _product_fwd(x2d, q, scale, group_sizes, implementation, interpret, act_qtype):
  y = _product(x2d, q, scale, group_sizes, implementation, interpret, act_qtype)
  return y, (x2d, q, scale, group_sizes)


def _product_bwd(implementation, interpret, act_qtype, residuals, dy):
  """dx[m] = dy[m] @ W[g(m)]^T (the reference's loop when `implementation` is 'reference', else
  the XLA walk over the routed experts); the scales' gradient by the XLA walk; no gradient for
  the int8 values or the group sizes."""
  del interpret, act_qtype  # a straight-through estimator on the activations' rounding
  x2d, q, scale, group_sizes = residuals
  if implementation == "reference":
    dx = reference.ragged_reference_t(dy, q, scale, group_sizes)
  else:
    dx = xla.ragged_xla_t(dy, q, scale, group_sizes)
  dscale = xla.ragged_xla_dscale(x2d, q, dy, group_sizes)
  return dx.astype(x2d.dtype), None, dscale.astype(scale.dtype), None


_product.defvjp(_product_fwd, _product_bwd)


def _hashable(implementation: ImplementationArg) -> str | tuple[str, ...] | None:
  if implementation is None or isinstance(implementation, str):
    return implementation
  return tuple(implementation)


def layer_experts(w: LayerSlice, group_sizes: jax.Array) -> tuple[Q8Array, jax.Array]:
  """Layer `w.layer`'s experts of a scanned model's stack, q (L, E, K_pad, N), as one stack of
  L * E experts (a reshape, no copy) whose groups outside the layer are empty: (the (L*E, K_pad,
  N) Q8Array, group sizes (L*E,) int32). The implementations read only experts with rows, so a
  layer's experts are read in place where slicing the layer out would copy all of them."""
  q, scale = w.stacked.q, w.stacked.scale
  if q.ndim != 4:
    raise ValueError(
      f"q8_ragged_matmul: a layer of stacked experts must be (L, E, K, N), got {tuple(q.shape)}"
    )
  layers, experts = q.shape[:2]
  flat = dataclasses.replace(
    w.stacked,
    q=q.reshape(layers * experts, *q.shape[2:]),
    scale=scale.reshape(layers * experts, *scale.shape[2:]),
    axis=1,
  )
  start = jnp.asarray(w.layer, jnp.int32) * experts
  sizes = jax.lax.dynamic_update_slice(
    jnp.zeros((layers * experts,), jnp.int32), jnp.asarray(group_sizes, jnp.int32), (start,)
  )
  return flat, sizes


def _explicitly_split(a: jax.Array) -> bool:
  """Whether `a`'s type carries a split axis (a mesh's Explicit axes)."""
  spec = getattr(jax.typeof(a).sharding, "spec", ())
  return any(entry is not None for entry in spec)


def run_ragged(
  x: jax.Array,
  w: Q8Array | LayerSlice,
  group_sizes: jax.Array,
  *,
  implementation: ImplementationArg = None,
  interpret: bool | None = None,
  preferred_element_type: Any = None,
  act_qtype: str | None = None,
) -> tuple[jax.Array, str]:
  """`q8_ragged_matmul`, and the name of the implementation it chose for the default backend
  (followed by ' (act q8_0)' with Q8_0 activations, as `kernels.run_product` names it); a
  `LayerSlice` of stacked experts runs as `layer_experts` lays it out (sliced out instead when
  a mesh's Explicit axes split it)."""
  if isinstance(w, LayerSlice):
    if _explicitly_split(w.stacked.q):  # a reshape of split axes needs its sharding spelled out
      w = w.take()
    else:
      w, group_sizes = layer_experts(w, group_sizes)
  check_ragged_operands(x, w, group_sizes)
  registry.check_implementation(implementation, OP)
  act_q8.check_act_qtype(act_qtype)
  m, k = x.shape
  experts, k_pad, n = w.shape
  chosen = resolve_ragged(m, k_pad, n, experts, x.dtype, None, implementation)
  if k_pad != k:  # K zero-padded to whole blocks: the padded rows meet zeros
    x = jnp.pad(x, ((0, 0), (0, k_pad - k)))
  group_sizes = jnp.asarray(group_sizes, jnp.int32)
  if m == 0 or n == 0:
    y = jnp.zeros((m, n), jnp.float32)
  else:
    y = _product(x, w.q, w.scale, group_sizes, _hashable(implementation), interpret, act_qtype)
  ran = chosen if act_qtype is None else f"{chosen} (act {act_qtype})"
  return y.astype(preferred_element_type or x.dtype), ran


def q8_ragged_matmul(x: jax.Array, w: Q8Array, group_sizes: jax.Array, **options: Any) -> jax.Array:
  """`out[m] = x[m] @ W[g(m)]` for rows sorted by group: `jax.lax.ragged_dot(x, W,
  group_sizes)` with E experts' Q8_0 weights.

  Args:
    x: (M, K) float32, bfloat16 or float16 activations, rows sorted by group.
    w: a `Q8Array` of q int8 (E, K_pad, N) and scale float32 or float16 (E, K_pad/32, N),
      blocked along axis 1 (`q8rules.quantize(w, axis=1)` of float experts (E, K_pad, N)); K_pad
      is K rounded up to a multiple of 32 (x is zero-padded to it).
    group_sizes: (E,) int32 rows per expert, in order; checked to sum to M when known now.
    **options: `run_ragged`'s keywords (the same defaults):
      implementation: None (the best for the platform), 'pallas', 'cpu', 'xla', 'reference', or
        a sequence of them (the first that can run); checked now for the default backend and
        resolved again per platform when the program is lowered.
      interpret: run the Pallas kernels in interpret mode (None: on CPU only).
      preferred_element_type: the output's dtype (default: x's).
      act_qtype: None (weight-only: float32-accurate, the default) or 'q8_0': the
        activations quantized to Q8_0 along K first, as llama.cpp does (opt-in).

  Returns:
    (M, N), accumulated in float32, in `preferred_element_type`.

  Differentiable in x (the transposed grouped product) and in the scales.

  Raises:
    TypeError, ValueError: the operands do not fit (`check_ragged_operands` names what is
      wrong), or no named implementation can run the product (each one's reason).
  """
  return run_ragged(x, w, group_sizes, **options)[0]


__all__ = [
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "OP",
  "layer_experts",
  "q8_ragged_matmul",
  "q8_ragged_product_p",
  "resolve_ragged",
  "run_ragged",
]
