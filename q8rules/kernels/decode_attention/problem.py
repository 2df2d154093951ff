"""What one decode-attention call is, as its implementations judge it (`AttentionProblem`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from q8rules.kernels.problem import platform_of

Reference = Callable[[jax.Array, jax.Array, jax.Array, Any, Any], jax.Array]
"""`reference(q (B, 1, H, D), keys, values (L, B, S, KV, D), slot, pos) -> (B, 1, H * D)`: a
caller's own XLA attention of the token at `pos` over layer `slot` of the cache."""


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


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
  """One token's attention over a layer of the cache.

  Attributes:
    q_shape: q's shape, (B, T, H, D) (one new token: T = 1).
    cache_shape: keys' (and values') shape, (L, B, S, KV, D).
    cache_dtype: the cache's dtype.
    mesh: whether a mesh of several devices is in context (the cache may be sharded: XLA's
      partitioner runs it; a one-device mesh, such as an export's abstract one, shards nothing).
    platform: 'cpu', 'gpu' or 'tpu'.
  """

  q_shape: tuple[int, ...]
  cache_shape: tuple[int, ...]
  cache_dtype: np.dtype
  mesh: bool
  platform: str

  @classmethod
  def of(cls, q: Any, keys: Any, backend: str | None = None) -> AttentionProblem:
    """The problem of q against cache keys on `backend` (None: `jax.default_backend()`),
    with the mesh in context now."""
    return cls(
      tuple(q.shape),
      tuple(keys.shape),
      np.dtype(keys.dtype),
      jax.sharding.get_abstract_mesh().size > 1,
      platform_of(backend),
    )

  def on(self, backend: str) -> AttentionProblem:
    """The same problem on another platform (when it is lowered for that one)."""
    return dataclasses.replace(self, platform=platform_of(backend))

  def describe(self) -> str:
    """'q (B, T, H, D) over a cache (L, B, S, KV, D) dtype', as messages name it."""
    return f"q {self.q_shape} over a cache {self.cache_shape} {self.cache_dtype}"


__all__ = ["AttentionParams", "AttentionProblem", "Reference"]
