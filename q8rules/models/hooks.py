"""The decoder's hooks: the two places where a kernel may serve the decoder better than plain
Flax, as plain Flax. Without a q8rules provider they run as written here; under `Q8Provider`
or `Q8QatProvider` (Qwix's interception, as for the products) they are routed to
`q8rules.kernels`: `take_layer` gives Q8_0 weights as `LayerSlice`s (the native CPU kernel
reads the layer in place instead of a copy), and `attend_one_token` runs op
'decode_attention' (the native CPU kernel where it runs). The models import nothing from
`q8rules.kernels`: what the attention hook and the kernel both take, one `AttentionCall`, lives
below both (`q8rules.attention_params`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import Array

from q8rules.attention_params import AttentionCall


def take_layer(tree: Any, i: jax.Array | int) -> Any:
  """Layer `i` of a stacked param tree: every array `a[i]`."""
  return jax.tree.map(lambda a: a[i], tree)


def attend_one_token(call: AttentionCall) -> Array:
  """One new token's attention over layer `call.slot` of the cache (`AttentionCall`'s shapes)
  -> (B, 1, H * D) float32. Here, the decoder's own attention `call.how.reference(call)`;
  `call.how.scale`, `call.how.softcap` and `call.sinks` are what a kernel needs to compute the
  same."""
  return call.how.reference(call).astype("float32")


__all__ = ["attend_one_token", "take_layer"]
