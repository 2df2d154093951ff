"""One new token's attention over one layer of the KV cache, op 'decode_attention': the
decoder's hot loop at decode.

Implementations, chosen by `kernels.registry.resolve` like every op's:

  'xla'  the caller's own softmax attention (`reference=`, e.g. the decoder's), else the
         plain-JAX reference (`reference.attend_one_token`): every backend, differentiable.
  'cpu'  the native library's kernel (`cpu.py`): float32, reads only the positions written so
         far, one custom call where XLA runs about a dozen; attention sinks included.

`implementation=None` takes 'cpu' where it can run (the native library builds here, one token,
a float32 or bfloat16 cache, no mesh in context: a sharded cache stays with XLA's partitioner)
and 'xla' otherwise. The choice is made again when the program is lowered, per platform
(`decode_attention_p`), so a program lowered for GPU or TPU runs 'xla'. Gradients go through
'xla' (a `custom_vjp` whose backward pass is the reference's).

A model does not call this: `q8rules.models` calls its own hook
(`q8rules.models.hooks.attend_one_token`, plain Flax), and q8rules' providers route that hook
to `attend` (the same `AttentionCall`), as they route the model's products to the Q8_0 kernels.

    out = one_token(q, keys, values, slot, pos, scale=0.125, softcap=None, reference=ref)

Heads with sinks (gpt-oss's attn_sinks: one more logit per head, in its softmax's denominator
only) pass `sinks=` (H,) float32, an operand like q (a scanned decoder's are traced).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.extend.core import Primitive

from q8rules.attention_params import AttentionCall, AttentionParams, Reference
from q8rules.kernels import lowering, registry
from q8rules.kernels.decode_attention import cpu, xla
from q8rules.kernels.decode_attention.problem import AttentionProblem
from q8rules.kernels.problem import platform_of

DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("xla",),
  "tpu": ("xla",),
}
"""What `implementation=None` tries, per platform; the last always runs."""

OP = registry.register(
  registry.Op.of("decode_attention", (cpu, xla), DEFAULT_ORDER, fallback="xla")
)
"""The op: its implementations and default order."""

IMPLEMENTATIONS = OP.names
"""The implementations `one_token` takes by name."""


def _operands(call: AttentionCall) -> tuple[Array, ...]:
  """The primitive's operands of `call`: q, keys, values, slot () int32, pos () or (B,) int32
  and sinks (H,) float32 ((0,): none)."""
  slot, pos = jnp.asarray(call.slot, jnp.int32), jnp.asarray(call.pos, jnp.int32)
  sinks = call.sinks
  sinks = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
  return call.q, call.keys, call.values, slot, pos, sinks


def _call(how: AttentionParams, q, keys, values, slot, pos, sinks) -> AttentionCall:
  """The `AttentionCall` of the primitive's operands (`_operands`' inverse)."""
  return AttentionCall(q, keys, values, slot, pos, how, sinks if sinks.shape[0] else None)


def _run_on(platform: str, *operands: Array, problem, implementation, how) -> Array:
  """The attention as `platform` runs it: (B, 1, H * D) float32."""
  name = registry.resolve(OP, problem.on(platform), implementation)
  return OP.implementations[name].run(_call(how, *operands))


decode_attention_p = Primitive("q8_decode_attention")
"""q (B, 1, H, D), keys, values (L, B, S, KV, D), slot (), pos () or (B,), sinks (H,) float32
((0,): none) -> (B, 1, H * D) float32; lowered per platform by `registry.resolve`."""


@decode_attention_p.def_abstract_eval
def _abstract_eval(q, keys, values, slot, pos, sinks, **params):
  del keys, values, slot, pos, sinks, params
  b, t, h, d = q.shape
  return jax.core.ShapedArray((b, t, h * d), jnp.float32)


@decode_attention_p.def_impl
def _impl(*operands, **params):
  return _run_on(platform_of(), *operands, **params)


lowering.lower_per_platform(decode_attention_p, _run_on)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _kernel(problem, implementation, how, *operands):
  params = {"problem": problem, "implementation": implementation, "how": how}
  return decode_attention_p.bind(*operands, **params)


def _kernel_fwd(problem, implementation, how, *operands):
  return _kernel(problem, implementation, how, *operands), operands


def _kernel_bwd(problem, implementation, how, residuals, g):
  del problem, implementation
  q, keys, values, slot, pos, sinks = residuals

  def ref(q, k, v, sinks):
    return xla.run(_call(how, q, k, v, slot, pos, sinks))

  _, vjp = jax.vjp(ref, q, keys, values, sinks)
  dq, dk, dv, dsinks = vjp(g)
  return dq, dk, dv, None, None, dsinks


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def attend(call: AttentionCall, implementation: str | None = None) -> Array:
  """`one_token` of one `AttentionCall`: what a q8rules provider runs in place of the
  decoder's hook `attend_one_token`, which takes the same call."""
  problem = AttentionProblem.of(call.q, call.keys)
  name = registry.resolve(OP, problem, implementation)
  if name == xla.NAME:
    return xla.run(call)
  return _kernel(problem, implementation, call.how, *_operands(call))


def one_token(
  q: Array,
  keys: Array,
  values: Array,
  slot: Any,
  pos: Any,
  *,
  scale: float,
  softcap: Any,
  reference: Reference | None = None,
  implementation: str | None = None,
  sinks: Array | None = None,
) -> Array:
  """The attention of one new token over layer `slot` of the cache.

  Args:
    q, keys, values, slot, pos, sinks: the operands, as `AttentionCall`'s fields (q
      (B, 1, H, D), the cache (L, B, S, KV, D), pos a scalar or (B,), sinks (H,) or None).
    scale, softcap, reference: as `AttentionParams`' fields (reference None: the plain-JAX
      reference).
    implementation: None (the best that runs), 'cpu' or 'xla'.

  Returns:
    (B, 1, H * D) float32.

  Raises:
    ValueError: an unknown implementation, or 'cpu' where it cannot run (the reason named);
      sinks of another shape than (H,).
  """
  how = AttentionParams.of(scale, softcap, reference)
  return attend(AttentionCall(q, keys, values, slot, pos, how, sinks), implementation)


__all__ = [
  "AttentionCall",
  "AttentionParams",
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "OP",
  "AttentionProblem",
  "Reference",
  "attend",
  "decode_attention_p",
  "one_token",
]
