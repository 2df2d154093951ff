"""One new token's attention over one layer of the KV cache: the decoder's hot loop at decode.

Two implementations, as `implementation=` names them:

  'xla'  the decoder's own softmax attention (`q8rules.models.attention`, passed in as
         `reference`): the reference, every backend, differentiable.
  'cpu'  the native library's kernel (`kernels/cpu/decode_attention.h`): float32, reads only
         the positions written so far, one custom call where XLA runs about a dozen (two
         copies of the layer's keys and values into its dots' layouts, the dots, the mask
         and the softmax's reductions). On SmolLM-135M's 30 layers that was 10-25 % of a
         decode step at 2 threads (RESULTS.md, issue 21).

`implementation=None` takes 'cpu' where it can run (the native library builds here, one token,
a float32 or bfloat16 cache, no mesh in context: a sharded cache stays with XLA's partitioner)
and 'xla' otherwise; 'cpu' is chosen again when the program is lowered
(`jax.lax.platform_dependent`), so a program lowered for GPU or TPU runs 'xla'. Gradients go
through 'xla' (a `custom_vjp` whose backward pass is the reference's).

    out = one_token(q, keys, values, slot, pos, scale=0.125, softcap=None, reference=ref)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from q8rules.kernels import cpu_native

IMPLEMENTATIONS = ("cpu", "xla")
"""The implementations `one_token` takes by name."""

Reference = Callable[[jax.Array, jax.Array, jax.Array, Any, Any], jax.Array]
"""`reference(q (B, 1, H, D), keys, values (L, B, S, KV, D), slot, pos) -> (B, 1, H * D)`
float32: the XLA attention of the token at `pos` over layer `slot` of the cache."""


def cannot_native(q: jax.Array, keys: jax.Array) -> str | None:
  """Why 'cpu' cannot run this call here (None: it can)."""
  if not cpu_native.available():
    return f"the native CPU library is unavailable: {cpu_native.unavailable_reason()}"
  if q.ndim != 4 or q.shape[1] != 1:
    return f"it runs one new token (q (B, 1, H, D)), got q {tuple(q.shape)}"
  if keys.dtype not in (jnp.float32, jnp.bfloat16):
    return f"the cache must be float32 or bfloat16, got {keys.dtype}"
  if not jax.sharding.get_abstract_mesh().empty:
    return "a mesh is in context (the cache may be sharded: XLA's partitioner runs it)"
  return None


def _native_or_reference(reference, scale, softcap, q, keys, values, slot, pos):
  b, _, h, d = q.shape

  def native(q, keys, values, slot, pos):
    out = cpu_native.decode_attention_cpu(
      q[:, 0], keys, values, slot, pos, scale=scale, softcap=softcap
    )
    return out.reshape(b, 1, h * d)

  def xla(q, keys, values, slot, pos):
    return reference(q, keys, values, slot, pos).astype(jnp.float32)

  return jax.lax.platform_dependent(q, keys, values, slot, pos, cpu=native, default=xla)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fast(reference, scale, softcap, q, keys, values, slot, pos):
  return _native_or_reference(reference, scale, softcap, q, keys, values, slot, pos)


def _fast_fwd(reference, scale, softcap, q, keys, values, slot, pos):
  out = _native_or_reference(reference, scale, softcap, q, keys, values, slot, pos)
  return out, (q, keys, values, slot, pos)


def _fast_bwd(reference, scale, softcap, residuals, g):
  del scale, softcap
  q, keys, values, slot, pos = residuals
  _, vjp = jax.vjp(
    lambda q, k, v: reference(q, k, v, slot, pos).astype(jnp.float32), q, keys, values
  )
  return (*vjp(g), None, None)


_fast.defvjp(_fast_fwd, _fast_bwd)


def one_token(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  slot: Any,
  pos: Any,
  *,
  scale: float,
  softcap: float | None,
  reference: Reference,
  implementation: str | None = None,
) -> jax.Array:
  """The attention of one new token over layer `slot` of the cache.

  Args:
    q: (B, 1, H, D), RoPE applied (any float dtype; the kernel reads it as float32).
    keys, values: (L, B, S, KV, D), the whole cache with the token already written at `pos`.
    slot: int32 scalar, the layer; pos: int32 scalar, the token's position (positions
      [0, pos] are attended).
    scale: the scores' factor (1 / sqrt(D) unless the model says otherwise); softcap: None,
      or the cap of `softcap * tanh(scores / softcap)`.
    reference: the XLA attention ('xla'; see `Reference`).
    implementation: None (the best that runs), 'cpu' or 'xla'.

  Returns:
    (B, 1, H * D) float32.

  Raises:
    ValueError: an unknown implementation, or 'cpu' where it cannot run (the reason named).
  """
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(
      f"decode attention: implementation must be None or one of {IMPLEMENTATIONS}, got"
      f" {implementation!r}"
    )
  reason = cannot_native(q, keys) if implementation != "xla" else "'xla' was asked for"
  if implementation == "cpu" and reason is not None:
    raise ValueError(f"decode attention: 'cpu' cannot run here: {reason}")
  if reason is not None:
    return reference(q, keys, values, slot, pos).astype(jnp.float32)
  slot, pos = jnp.asarray(slot, jnp.int32), jnp.asarray(pos, jnp.int32)
  return _fast(reference, float(scale), softcap and float(softcap), q, keys, values, slot, pos)


__all__ = ["IMPLEMENTATIONS", "Reference", "cannot_native", "one_token"]
