"""One new token's attention call as one value (`AttentionCall`: its operands and its
`AttentionParams`): the one argument the decoder's hook (`q8rules.models.hooks.attend_one_token`),
op 'decode_attention' (`q8rules.kernels.decode_attention`), each of its implementations and a
caller's own attention (`Reference`) take, so the models and the kernels share it without
importing each other, and the call's arguments are written out once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Reference = Callable[["AttentionCall"], jax.Array]
"""`reference(call) -> (B, 1, H * D)`: a caller's own XLA attention of `call` (the token at
`call.pos` over layer `call.slot` of the cache, with `call.sinks`)."""


@dataclasses.dataclass(frozen=True)
class AttentionParams:
  """What an implementation computes besides its operands (hashable: a primitive's params).

  Attributes:
    scale: the scores' factor (1 / sqrt(D) unless the model says otherwise).
    softcap: None, or the cap of `softcap * tanh(scores / softcap)`.
    reference: the caller's own XLA attention ('xla' runs it), or None (the plain-JAX one).
  """

  scale: float
  softcap: float | None
  reference: Reference | None = None

  @classmethod
  def of(cls, scale: Any, softcap: Any, reference: Reference | None = None) -> AttentionParams:
    """The params with `scale` and `softcap` as Python floats (a falsy `softcap` kept as it
    is: no cap), so that equal params hash alike as a primitive's parameters."""
    return cls(float(scale), softcap and float(softcap), reference)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
  """One new token's attention over layer `slot` of the cache.

  Attributes:
    q: (B, 1, H, D), RoPE applied (any float dtype; float32 inside).
    keys, values: (L, B, S, KV, D), the whole cache with the token already written at `pos`.
    slot: int32 scalar, the layer.
    pos: int32 scalar, the token's position (positions [0, pos] are attended), or int32 (B,),
      one per row (row b attends [0, pos[b]]).
    how: the scale, softcap and the caller's own attention (`AttentionParams`).
    sinks: (H,) float32, each head's sink logit: one more term of its softmax's denominator,
      with no value (ggml's soft_max with sinks; gpt-oss's attn_sinks); None: none.

  Raises (on construction):
    ValueError: sinks of another shape than (H,).
  """

  q: jax.Array
  keys: jax.Array
  values: jax.Array
  slot: Any
  pos: Any
  how: AttentionParams
  sinks: jax.Array | None = None

  def __post_init__(self) -> None:
    heads = self.q.shape[2:3]
    if self.sinks is not None and jnp.shape(self.sinks) != heads:
      raise ValueError(f"sinks must be one logit per head {heads}, got {jnp.shape(self.sinks)}")

  @property
  def scale(self) -> float:
    """The scores' factor (`how.scale`)."""
    return self.how.scale

  @property
  def softcap(self) -> float | None:
    """None, or the scores' tanh cap (`how.softcap`)."""
    return self.how.softcap


__all__ = ["AttentionCall", "AttentionParams", "Reference"]
