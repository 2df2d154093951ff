"""`LayerSlice`: one layer of stacked Q8_0 weights, named by a (traced) layer index, not copied.

A scanned model keeps each weight stacked over its layers: q (L, K, N), scale (L, K/32, N).
Slicing layer i out inside the scan (what `nn.scan` does with its params) makes XLA copy
the slice before a custom call that cannot take a view, so the native CPU kernel would read
a copy of every weight every step. A `LayerSlice` carries the stacked arrays and the index
instead; `q8_matmul` runs it where an implementation reads the layer in place (the native
CPU kernel: `matmul.cpu.q8_matmul_cpu_layer`) and slices it first everywhere else (the fold
on GPU/TPU, the XLA paths), per platform when the program is lowered (`api.py`).

`layer_of(tree, i)` is layer i of a stacked param tree: each `Q8Array` a `LayerSlice`, each
other array `a[i]`. Shapes: `LayerSlice.shape` is one layer's (K, N).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.q8_0 import Q8Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
  """Layer `layer` of `stacked`, a Q8Array of q (L, K, N) int8 and scale (L, K/32, N).

  Attributes:
    stacked: the stacked weights; its `axis` is one layer's blocked axis (0: K), as a
      scanned model's stacked params keep it.
    layer: () int32, the layer's index (may be traced), in [0, L).
  """

  stacked: Q8Array
  layer: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """One layer's (K, N)."""
    return tuple(self.stacked.q.shape[1:])

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def axis(self) -> int:
    return self.stacked.axis

  @property
  def dtype(self) -> Any:
    return self.stacked.dtype

  @property
  def nbytes(self) -> int:
    """One layer's bytes (values and scales)."""
    return self.stacked.nbytes // int(self.stacked.q.shape[0])

  def spec(self) -> Q8Array:
    """One layer's (K, N) Q8Array of shapes and dtypes (nothing sliced), for operand checks."""
    q, scale = self.stacked.q, self.stacked.scale
    return dataclasses.replace(
      self.stacked,
      q=jax.ShapeDtypeStruct(tuple(q.shape[1:]), q.dtype),
      scale=jax.ShapeDtypeStruct(tuple(scale.shape[1:]), scale.dtype),
    )

  def take(self) -> Q8Array:
    """The layer as its own (K, N) Q8Array: a dynamic slice (XLA may copy it)."""
    i = jnp.asarray(self.layer, jnp.int32)
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)  # noqa: E731
    return dataclasses.replace(self.stacked, q=pick(self.stacked.q), scale=pick(self.stacked.scale))


def check_stacked(w: LayerSlice, what: str = "q8_matmul") -> None:
  """Raise a clear error unless `w.stacked` holds q (L, K, N) and scale (L, K/32, N) (one
  layer's dtypes and shapes `check_operands` checks) and `w.layer` is an integer scalar."""
  q, scale = w.stacked.q, w.stacked.scale
  if len(q.shape) != 3:
    raise ValueError(
      f"{what}: a LayerSlice needs stacked values (L, K, N), got shape {tuple(q.shape)}"
    )
  if tuple(scale.shape[:1]) != tuple(q.shape[:1]):
    raise ValueError(
      f"{what}: stacked scales {tuple(scale.shape)} and values {tuple(q.shape)} differ in L"
    )
  layer = jnp.asarray(w.layer) if not isinstance(w.layer, jax.Array) else w.layer
  if layer.shape != () or not np.issubdtype(layer.dtype, np.integer):
    raise TypeError(
      f"{what}: a LayerSlice's layer must be an integer scalar, got {layer.dtype}{layer.shape}"
    )


def layer_of(tree: Any, i: jax.Array | int) -> Any:
  """Layer `i` of a stacked param tree: each `Q8Array` (L, K, N) as a `LayerSlice` (read in
  place by the kernels that can), each other array `a[i]` (XLA fuses such slices into their
  consumers)."""
  index = jnp.asarray(i, jnp.int32)

  def take(a: Any) -> Any:
    if isinstance(a, Q8Array):
      return LayerSlice(a, index)
    return a[index]

  return jax.tree.map(take, tree, is_leaf=lambda a: isinstance(a, Q8Array))


__all__ = ["LayerSlice", "check_stacked", "layer_of"]
