"""`load_gguf(path, trainable='qat')`: a GGUF model with float params, for full fine-tuning.

Every matrix the served model holds as Q8_0 (the file's Q8_0 blocks, or another quantized
type requantized at load) becomes a float32 param equal to its Q8_0 values exactly: `q * d`
(an int8 times a float16 needs 18 significant bits: exact in float32). The model is the
served model's `Transformer`, quantized by `q8rules.Q8QatProvider` with the same rule (the
same module paths, float16 scales), so a product's forward pass quantizes the float param to
Q8_0 and runs the serving kernel on it (the served model's outputs, to float32 rounding), and
its gradient is the straight-through one. Quantizing `q * d` again gives back the file's
`q` and `d` (the Q8_0 quantizer's largest |q| is 127, so the block's absmax is 127 d), so an
untrained QAT model serves exactly the file's blocks, and `GGUFModel.save_gguf` writes them
back as they were.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from q8rules._qwix import is_with_aux, unbox
from q8rules.q8_0 import BLOCK, Q8Array

TRAINABLE = (None, "qat")
"""The values of `load_gguf(..., trainable=)`."""


@jax.jit
def q8_values(q: jax.Array, scale: jax.Array) -> jax.Array:
  """float32 `q * d` of a Q8_0 matrix in the kernel layout: q (..., K, N) int8, scale
  (..., K / 32, N) float16 or float32 (each scale over 32 rows of q) -> (..., K, N) float32,
  exact (an int8 times a float16 is a float32 value)."""
  *lead, k, n = q.shape
  blocks = q.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK, n)
  return (blocks * scale.astype(jnp.float32)[..., None, :]).reshape(*lead, k, n)


def qat_params(params: Any) -> Any:
  """`params` (a served GGUF model's) with each Q8 param (`WithAux(Q8Array, how)`, or a bare
  Q8Array) replaced by its float32 values (`q8_values`), placed as its int8 values were."""

  def to_float(leaf: Any) -> Any:
    leaf = unbox(leaf)
    array = leaf.array if is_with_aux(leaf) else leaf
    if not isinstance(array, Q8Array):
      return leaf
    return q8_values(array.q, array.scale)

  is_q8 = lambda x: is_with_aux(x) or isinstance(x, Q8Array)  # noqa: E731
  return jax.tree.map(to_float, params, is_leaf=is_q8)


__all__ = ["TRAINABLE", "q8_values", "qat_params"]
