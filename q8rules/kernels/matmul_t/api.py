"""The transposed Q8_0 product, op 'matmul_t': `q8_matmul_t(dy, w)` = dy @ W^T, the gradient of
x @ W with respect to x, for a frozen Q8_0 weight W = q int8 (K, N) * scale (K/32, N).

The contraction runs along N while the Q8_0 blocks run along K, so the forward product's
kernels do not serve it. Implementations, chosen by `kernels.registry.resolve` like every op's,
at trace time and again per platform when the program is lowered (`q8_matmul_t_p`):

  'cpu'        the native library (`cpu.py`, `kernels/cpu/q8_matmul_t.h`): q streamed row by
               row (contiguous in the (K, N) layout), SIMD over N, threads over K.
  'xla'        every backend (`xla.py`): a `lax.map` over chunks of K rows, each dequantised
               into one (chunk, N) float32 slab, dy @ slab^T at `Precision.HIGHEST`.
  'reference'  the whole weight dequantised, one dot (`reference.py`; the yardstick).

None of 'cpu' and 'xla' builds the whole float weight. All accumulate in float32 and are held
to float64 within 1e-5 (relative, ||out - ref|| / ||ref||) by the tests.

The weight-only product's derivative with respect to x goes through this op: its x-tangent is
`linear_in_x` (`q8_linear_x_p`, x @ W as a primitive linear in x), whose transpose rule is
`q8_matmul_t_p`, and the transpose of `q8_matmul_t_p` is `q8_linear_x_p` again, so reverse mode,
`grad` of `grad`, `vmap`, `jit`, `jax.checkpoint` and `lax.scan` all compose. The weight's int8
values get no cotangent (the base is frozen); the scales' cotangent stays the XLA path's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from q8rules.kernels import lowering, registry
from q8rules.kernels.matmul.xla_chunked import q8_matmul_xla
from q8rules.kernels.matmul_t import cpu, reference, xla
from q8rules.kernels.matmul_t.problem import TransposedProblem, check_operands_t
from q8rules.kernels.registry import ImplementationArg
from q8rules.q8_0 import Q8Array

DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("xla",),
  "tpu": ("xla",),
}
"""What `implementation=None` tries, per platform (the last always runs): the native kernel on
the CPU, the XLA chunks on GPU and TPU."""

OP = registry.register(
  registry.Op.of("matmul_t", (cpu, xla, reference), DEFAULT_ORDER, fallback="xla")
)
"""The op: its implementations and default order."""

IMPLEMENTATIONS = OP.names
"""The implementations of the transposed product."""


def resolve_t(
  m: int,
  k: int,
  n: int,
  dtype: Any = jnp.float32,
  backend: str | None = None,
  implementation: ImplementationArg = None,
) -> str:
  """The implementation that runs an (m, N) x (K, N)^T product with `dtype` cotangents on
  `backend` (None: the default backend): `registry.resolve` of op 'matmul_t'."""
  return registry.resolve(OP, TransposedProblem.of(m, k, n, dtype, backend), implementation)


def backward_implementation(forward: ImplementationArg) -> tuple[str, ...] | None:
  """The `implementation=` of this op that serves the gradient of a weight-only product run
  with `implementation=forward`: the names this op shares with it ('cpu', 'xla',
  'reference'), in order, else None (the best for the platform: the fold's and
  'xla_dequant''s gradients run the native kernel on the CPU up to 16 rows and 'xla'
  elsewhere)."""
  shared = tuple(n for n in registry.implementation_names(forward) if n in OP.implementations)
  return shared or None


# ---- the transposed product, dispatched when it is lowered ------------------------------


def _run_on(platform: str, dy2d, q, scale, *, implementation) -> jax.Array:
  """The product as `platform` runs it: (m, N) @ (K, N)^T -> (m, K) float32."""
  m, n = dy2d.shape
  name = resolve_t(m, q.shape[0], n, dy2d.dtype, platform, implementation)
  return OP.implementations[name].run(dy2d, q, scale)


q8_matmul_t_p = lowering.float32_primitive(
  "q8_matmul_t", lambda dy2d, q, scale: (dy2d.shape[0], q.shape[0]), _run_on
)
"""dy2d (m, N), q (K, N) int8, scale (K/32, N) -> (m, K) float32; lowered per platform by
`resolve`; linear in dy (its transpose is `q8_linear_x_p`)."""

q8_linear_x_p = Primitive("q8_linear_x")
"""x2d (m, K), q (K, N) int8, scale (K/32, N) -> (m, N) float32: the weight-only product as a
primitive linear in x (the XLA scan, `matmul.xla_chunked`), the x-tangent of every product's
implementation; its transpose is `q8_matmul_t_p` with `implementation`."""


@q8_linear_x_p.def_abstract_eval
def _x_abstract_eval(x2d, q, scale, **params):
  del scale, params
  return jax.core.ShapedArray((x2d.shape[0], q.shape[1]), jnp.float32)


def _linear_x(x2d, q, scale, *, implementation):
  del implementation
  return q8_matmul_xla(x2d, q, scale)


q8_linear_x_p.def_impl(_linear_x)
mlir.register_lowering(q8_linear_x_p, mlir.lower_fun(_linear_x, multiple_results=False))


def _transpose_to(other: Primitive):
  """The transpose rule of a primitive linear in its first operand: the cotangent of that
  operand is `other` on the cotangent, in the operand's dtype; q and scale get none (they
  must be known: the scale's cotangent comes from the XLA path, `_bilinear`)."""

  def rule(ct, a, q, scale, **params):
    if ad.is_undefined_primal(q) or ad.is_undefined_primal(scale):
      raise NotImplementedError("the Q8_0 weight is not a linear operand of this primitive")
    if type(ct) is ad.Zero:
      return ad.Zero(a.aval), None, None
    return other.bind(ct, q, scale, **params).astype(a.aval.dtype), None, None

  return rule


ad.primitive_transposes[q8_matmul_t_p] = _transpose_to(q8_linear_x_p)
ad.primitive_transposes[q8_linear_x_p] = _transpose_to(q8_matmul_t_p)


def _jvp_of(p: Primitive, in_scale):
  """The JVP rule of `p` (linear in its first operand, bilinear with the scales): the first
  operand's tangent through `p`, the scales' through `in_scale(a, q, tscale)` (XLA)."""

  def rule(primals, tangents, **params):
    a, q, scale = primals
    ta, _, tscale = tangents
    out = p.bind(a, q, scale, **params)
    parts = []
    if type(ta) is not ad.Zero:
      parts.append(p.bind(ta, q, scale, **params))
    if type(tscale) is not ad.Zero:
      parts.append(in_scale(a, q, tscale))
    return out, sum(parts[1:], parts[0]) if parts else jnp.zeros_like(out)

  return rule


ad.primitive_jvps[q8_matmul_t_p] = _jvp_of(q8_matmul_t_p, xla.q8_matmul_t_xla)
ad.primitive_jvps[q8_linear_x_p] = _jvp_of(q8_linear_x_p, q8_matmul_xla)


def _batch_of(p: Primitive):
  """The batching rule of `p` (a (m, *) operand against one weight): a batch of the first
  operand folds into its rows (one read of the weight); a batched weight runs once per
  element (`lax.map`)."""

  def rule(args, dims, **params):
    a, q, scale = args
    da, dq, ds = dims
    if dq is None and ds is None:
      a = jnp.moveaxis(a, da, 0)
      b, m = a.shape[:2]
      out = p.bind(a.reshape(b * m, a.shape[2]), q, scale, **params)
      return out.reshape(b, m, out.shape[1]), 0
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)

    def batched(x, d):
      if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
      return jnp.moveaxis(x, d, 0)

    xs = tuple(batched(x, d) for x, d in zip(args, dims, strict=True))
    return jax.lax.map(lambda t: p.bind(*t, **params), xs), 0

  return rule


batching.primitive_batchers[q8_matmul_t_p] = _batch_of(q8_matmul_t_p)
batching.primitive_batchers[q8_linear_x_p] = _batch_of(q8_linear_x_p)


def _hashable(implementation: ImplementationArg) -> str | tuple[str, ...] | None:
  if implementation is None or isinstance(implementation, str):
    return implementation
  return tuple(implementation)


def linear_in_x(
  x2d: jax.Array, q: jax.Array, scale: jax.Array, implementation: ImplementationArg = None
) -> jax.Array:
  """x2d (m, K) @ (q (K, N) * scale (K/32, N)) -> (m, N) float32, linear in x2d, whose
  transpose (the gradient with respect to x) is this op with `implementation`. The
  weight-only product's x-tangent (`matmul._bilinear`)."""
  return q8_linear_x_p.bind(x2d, q, scale, implementation=_hashable(implementation))


def q8_matmul_t(
  dy: jax.Array,
  w: Q8Array,
  *,
  implementation: ImplementationArg = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """`dy @ W^T` for dy (..., N) float32/bfloat16/float16 and W a (K, N) Q8Array.

  Accumulates in float32 and returns (..., K) in `preferred_element_type` (default: dy's
  dtype). `implementation` as `registry.resolve` ('cpu', 'xla', 'reference', a sequence of
  them, or None: the best for the platform); checked now for the default backend and resolved
  again per platform when the program is lowered. Differentiable in dy (its transpose is the
  weight-only product) and in the scales.

  Raises:
    TypeError, ValueError: the operands do not fit (`check_operands_t`), or no named
      implementation can run the product (each one's reason).
  """
  check_operands_t(dy, w)
  registry.check_implementation(implementation, OP)
  k, n = w.shape
  dy2d = dy.reshape(-1, n)
  m = dy2d.shape[0]
  resolve_t(m, k, n, dy.dtype, None, implementation)  # a clear error at trace time
  if m == 0 or k == 0 or n == 0:
    y = jnp.zeros((m, k), jnp.float32)
  else:
    y = q8_matmul_t_p.bind(dy2d, w.q, w.scale, implementation=_hashable(implementation))
  return y.reshape(*dy.shape[:-1], k).astype(preferred_element_type or dy.dtype)


__all__ = [
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "OP",
  "backward_implementation",
  "linear_in_x",
  "q8_linear_x_p",
  "q8_matmul_t",
  "q8_matmul_t_p",
  "resolve_t",
]
