"""'xla': the caller's own XLA attention (`reference=`), or `reference.attend_one_token`; every
backend, differentiable."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from q8rules.attention_params import AttentionCall
from q8rules.kernels.decode_attention.problem import AttentionProblem
from q8rules.kernels.decode_attention.reference import attend_one_token

NAME = "xla"
SUMMARY = "the caller's XLA attention (else the plain-JAX reference), every backend"


def cannot(p: AttentionProblem) -> None:
  """It runs every problem."""
  del p


def slower(p: AttentionProblem) -> None:
  """Where `implementation=None` ends."""
  del p


def run(call: AttentionCall) -> Array:
  """(B, 1, H * D) float32: the caller's `call.how.reference(call)`, or the plain-JAX
  reference."""
  if call.how.reference is None:
    return attend_one_token(call)
  return call.how.reference(call).astype(jnp.float32)


__all__ = ["NAME", "SUMMARY", "cannot", "run", "slower"]
