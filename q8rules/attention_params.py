"""What one new token's attention computes besides its operands (`AttentionParams`): the one
argument the decoder's hook (`q8rules.models.hooks.attend_one_token`) and op
'decode_attention' (`q8rules.kernels.decode_attention`) both take, so the models and the
kernels share it without importing each other."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

Reference = Callable[[jax.Array, jax.Array, jax.Array, Any, Any, Any], jax.Array]
"""`reference(q (B, 1, H, D), keys, values (L, B, S, KV, D), slot, pos, sinks) -> (B, 1, H * D)`:
a caller's own XLA attention of the token at `pos` over layer `slot` of the cache, `sinks` each
head's sink logit (H,) float32 (one more term of its softmax's denominator), or None."""


@dataclasses.dataclass(frozen=True)
class AttentionParams:
  """What an implementation computes besides its operands.

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


__all__ = ["AttentionParams", "Reference"]
