"""What one decode-attention call is, as its implementations judge it (`AttentionProblem`; what
they compute besides the operands is `q8rules.attention_params.AttentionParams`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from q8rules.kernels.problem import platform_of


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


__all__ = ["AttentionProblem"]
