"""'xla': the Q8_0 x Q8_0 product as the activations' round trip through XLA's weight-only
product (`matmul.xla_chunked`), on every backend."""

from __future__ import annotations

import jax

from q8rules.kernels.matmul.xla_chunked import q8_matmul_xla
from q8rules.kernels.matmul_act_q8.reference import round_trip
from q8rules.kernels.problem import Problem

NAME = "xla"
SUMMARY = "the activations' Q8_0 round trip through the XLA scan, every shape and backend"


def cannot(p: Problem) -> None:
  """It runs every problem."""
  del p


def slower(p: Problem) -> None:
  """Where `implementation=None` ends."""
  del p


def q8_matmul_act_xla(x2d: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """`Q8_0(x2d) @ (q * scale)` in XLA: x2d (m, K) float, q (K, N) int8, scale (K/32, N) float32
  or float16 -> (m, N) float32."""
  return q8_matmul_xla(round_trip(x2d), q, scale)


def run(
  x2d: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
  """On x2d (m, K) and q (K, N), scale (K/32, N) or, with `layer`, layer `layer` of stacked
  q (L, K, N), scale (L, K/32, N) (sliced out): (m, N) float32."""
  if layer is not None:
    q = jax.lax.dynamic_index_in_dim(q, layer, 0, keepdims=False)
    scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)
  return q8_matmul_act_xla(x2d, q, scale)


__all__ = ["NAME", "SUMMARY", "cannot", "q8_matmul_act_xla", "run", "slower"]
