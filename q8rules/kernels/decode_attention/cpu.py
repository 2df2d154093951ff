"""'cpu': one new token's attention on the native CPU library (`kernels/native/`): float32,
reads only the positions written so far, one custom call where XLA runs about a dozen (two
copies of the layer's keys and values into its dots' layouts, the dots, the mask and the
softmax's reductions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from q8rules.attention_params import AttentionCall
from q8rules.kernels.decode_attention.problem import AttentionProblem
from q8rules.kernels.native import library
from q8rules.kernels.native.library import TARGET_DECODE_ATTENTION

NAME = "cpu"
SUMMARY = "the native CPU library (one custom call; float32 or bfloat16 cache)"

CACHE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
"""The cache dtypes the kernel reads."""


def decode_attention_cpu(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  slot: jax.Array,
  pos: jax.Array,
  *,
  scale: float,
  softcap: float | None,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """One new token's attention with the native kernel (`kernels/cpu/decode_attention.h`).

  Args:
    q: (B, H, D) float32, RoPE applied.
    keys, values: (L, B, S, KV, D) float32 or bfloat16: the cache, the token already written.
    slot: () int32, the layer; pos: () int32, the token's position (positions [0, pos] are
      attended, clamped to S), or (B,) int32, one per row (row b attends [0, pos[b]]).
    scale: the scores' factor; softcap: None or the tanh cap of the scores.
    sinks: (H,) float32, each head's sink logit (one more term of its softmax's denominator,
      as ggml's soft_max with sinks), or None (none).

  Returns:
    (B, H, D) float32.
  """
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(TARGET_DECODE_ATTENTION, out)(
    q.astype(jnp.float32),
    keys,
    values,
    jnp.asarray(slot, jnp.int32),
    jnp.asarray(pos, jnp.int32),
    jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32),
    scale=np.float32(scale),
    softcap=np.float32(softcap or 0.0),
  )


def cannot(p: AttentionProblem) -> str | None:
  """Why the kernel cannot run `p` (None: it can)."""
  if p.platform != "cpu":
    return f"the native CPU library runs on the CPU only, not {p.platform}"
  if not library.available():
    return f"the native CPU library is unavailable: {library.unavailable_reason()}"
  if len(p.q_shape) != 4 or p.q_shape[1] != 1:
    return f"it runs one new token (q (B, 1, H, D)), got q {p.q_shape}"
  if p.cache_dtype not in CACHE_DTYPES:
    return f"the cache must be float32 or bfloat16, got {p.cache_dtype}"
  if p.mesh:
    return "a mesh of several devices is in context (the cache may be sharded: XLA's partitioner runs it)"
  return None


def slower(p: AttentionProblem) -> None:
  """Where it runs, it is the fastest."""
  del p


def run(call: AttentionCall) -> Array:
  """(B, 1, H * D) float32 from `call` (q (B, 1, H, D), the cache (L, B, S, KV, D), sinks (H,)
  or None)."""
  b, _, h, d = call.q.shape
  out = decode_attention_cpu(
    call.q[:, 0],
    call.keys,
    call.values,
    call.slot,
    call.pos,
    scale=call.scale,
    softcap=call.softcap,
    sinks=call.sinks,
  )
  return out.reshape(b, 1, h * d)


__all__ = ["CACHE_DTYPES", "NAME", "SUMMARY", "cannot", "decode_attention_cpu", "run", "slower"]
