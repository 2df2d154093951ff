"""RoPE, the KV cache and causal GQA attention of the one decoder (global and sliding-window).

The KV cache of a model without sliding-window layers is one pair (k, v), each
(layers, batch, length, kv_heads, head_dim). With sliding-window ("local") layers
it is a dict of such pairs per kind of layer, each stacked over that kind's layers:

  {'global': (k, v) (global layers, batch, length, kv_heads, head_dim),
   'local':  (k, v) (local layers, batch, min(window, length), kv_heads, head_dim)}

A local layer's cache is a ring buffer of the window's length: position p lives at
slot p % R (R its length). A chunk of T new tokens at `pos` attends over the ring
(positions before `pos`) and the chunk itself, masked to the window, then the
chunk's last min(T, R) entries are written into the ring, so memory stays R
whatever the number of tokens decoded. A global layer's cache holds every position:
the chunk is written at `pos`, then read back whole, masked causally.

`pos` is one position for the whole batch (a scalar), or one per row (int32 (B,)): each row
then writes, masks and rotates at its own position (a batch of independent sequences, as a
server decodes them). One new token per row attends through `hooks.attend_one_token` with
the positions (B,), once for the batch: each row over its own positions alone (the native
kernel's rows, or the XLA attention's per-row mask), so each row's attention is the same
computation whatever the others hold.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from q8rules.attention_params import AttentionCall, AttentionParams
from q8rules.models import hooks, yarn
from q8rules.models.config import RopeStyle, TransformerConfig

Cache = Any
"""(k, v), each (layers, batch, length, kv_heads, head_dim) in the config's dtype; or, with
sliding-window layers, {'global': (k, v), 'local': (k, v)} (see the module docstring)."""


def rope_angles(
  config: TransformerConfig, positions: jax.Array, freq_factors: Any, local: bool = False
) -> jax.Array:
  """Angles (*P, head_dim / 2) float32 for integer positions (*P,) ((T,), or (B, T) per row),
  as llama.cpp's rope.

  Pair i at position p turns by `p * scale * base**(-2i / head_dim) / f_i`; base and
  scale are the local layers' when `local`; f_i from `freq_factors` (head_dim / 2,) or 1.
  With YaRN the scale is mixed per pair (`yarn.mix`).
  """
  c = config
  head_dim = c.head_dim_local if local and c.head_dim_local else c.head_dim
  half = head_dim // 2
  base = c.rope_base_local if local else c.rope_base
  inv_freq = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / head_dim)
  if freq_factors is not None:
    inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
  scale = _rope_scale(c, local)
  if c.rope_scaling == "yarn":  # the scale reaches the low frequencies only
    beta = (c.rope_yarn_beta_fast, c.rope_yarn_beta_slow)
    inv_freq = inv_freq * yarn.mix(2 * half, c.rope_original_context, base, scale, *beta)
    scale = 1.0
  return positions.astype(jnp.float32)[..., None] * scale * inv_freq


def _rope_scale(c: TransformerConfig, local: bool) -> float:
  """The frequency scale of a layer (llama.cpp's freq_scale: 1 / the scaling factor)."""
  if local:
    return 1.0 / c.rope_factor_local
  return 1.0 / c.rope_factor if c.rope_scaling is not None else 1.0


def rope_mscale(config: TransformerConfig, local: bool = False) -> float:
  """What cos and sin are multiplied by on a layer of that kind: `rope_attn_factor`, with YaRN
  times its magnitude correction (`yarn.mscale`)."""
  c = config
  if c.rope_scaling != "yarn":
    return c.rope_attn_factor
  return yarn.mscale(c.rope_factor, _rope_scale(c, local), c.rope_attn_factor)


def apply_rope(
  x: jax.Array, angles: jax.Array, style: RopeStyle, mscale: float | jax.Array = 1.0
) -> jax.Array:
  """Rotate x (B, T, N, H) by angles (T, H / 2) (or (B, T, H / 2), per row), in float32, cos
  and sin times `mscale` (a float, or a traced float32 scalar); returns x's dtype."""
  cos = jnp.cos(angles)[..., None, :]
  sin = jnp.sin(angles)[..., None, :]
  if not isinstance(mscale, float) or mscale != 1.0:
    cos, sin = cos * mscale, sin * mscale
  xf = x.astype(jnp.float32)
  if style == "interleaved":
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)
  else:
    half = x.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  return out.astype(x.dtype)


def init_cache(config: TransformerConfig, length: int, batch: int = 1) -> Cache:
  """An empty KV cache for `length` positions (see `Cache`), zeros in the config's dtype."""
  c = config
  if length > c.context_length:
    raise ValueError(f"a cache of {length} positions exceeds context_length {c.context_length}")

  def pair(kind: str, s: int) -> tuple[jax.Array, jax.Array]:
    n, kv_heads, head_dim = c.cache_dims(kind)
    shape = (n, batch, s, kv_heads, head_dim)
    return jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype)

  if c.layer_kinds == ("global",):
    return pair("global", length)
  sizes = {"global": length, "local": min(c.sliding_window, length)}
  return {kind: pair(kind, sizes[kind]) for kind in c.layer_kinds}


def _expected(config: TransformerConfig, batch: int) -> dict[str, tuple[Any, ...]]:
  c = config
  dims = {k: c.cache_dims(k) for k in c.layer_kinds}
  return {k: (n, batch, None, kv, h) for k, (n, kv, h) in dims.items()}


def check_cache(config: TransformerConfig, cache: Any, batch: int) -> None:
  """Raise a clear error unless `cache` has the structure and shapes `init_cache(config, length,
  batch)` gives it."""
  want = _expected(config, batch)
  groups = as_groups(config, cache, strict=False)

  def shapes(pair: Any) -> list[tuple[int, ...]] | None:
    if not (isinstance(pair, tuple | list) and len(pair) == 2):
      return None
    return [tuple(getattr(a, "shape", ())) for a in pair]

  got = {k: shapes(v) for k, v in groups.items()} if isinstance(groups, dict) else None
  ok = got is not None and set(got) == set(want)
  for kind, w in want.items():
    s = (got or {}).get(kind)
    ok = ok and s is not None and s[0] == s[1]
    ok = ok and len(s[0]) == 5 and all(a is None or a == b for a, b in zip(w, s[0], strict=True))
  if not ok:
    layout = ", ".join(
      f"{k}: (k, v) each (layers={w[0]}, batch={batch}, length, kv_heads={w[3]}, head_dim={w[4]})"
      for k, w in want.items()
    )
    raise ValueError(
      f"the KV cache must be as init_cache makes it ({layout}); got"
      f" {got if got is not None else type(cache).__name__}"
    )


def as_groups(config: TransformerConfig, cache: Any, strict: bool = True) -> Any:
  """The cache as {kind: (k, v)}: a bare (k, v) pair is the global layers' when the model has
  no local layers."""
  if config.layer_kinds == ("global",) and isinstance(cache, tuple | list):
    return {"global": tuple(cache)}
  if strict or isinstance(cache, dict):
    return cache
  return None


def from_groups(config: TransformerConfig, groups: dict[str, Any]) -> Cache:
  """Back to `init_cache`'s structure (the inverse of `as_groups`)."""
  return groups["global"] if config.layer_kinds == ("global",) else groups


def _scale(c: TransformerConfig) -> float:
  """The scores' factor: the config's, else 1 / sqrt(head_dim)."""
  return c.attn_scale if c.attn_scale is not None else 1.0 / float(c.head_dim) ** 0.5


def _attend_f32(
  c: TransformerConfig,
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  visible: jax.Array,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """Softmax attention of q (B, T, heads, H) over keys / values (B, S, kv_heads, H) where
  visible (T, S) (or (B, T, S), per row), with each head's sink logit (heads,) float32 in its
  softmax when given: (B, T, heads * H) float32 (the caller casts to the config's dtype)."""
  b, t = q.shape[:2]
  group = c.heads // c.kv_heads
  qg = q.reshape(b, t, c.kv_heads, group, c.head_dim).astype(jnp.float32)
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, keys.astype(jnp.float32))
  scores = scores * _scale(c)
  if c.attn_softcap:
    scores = jnp.tanh(scores / c.attn_softcap) * c.attn_softcap
  visible = visible[None, None, None] if visible.ndim == 2 else visible[:, None, None]
  scores = jnp.where(visible, scores, -jnp.inf)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:  # one more logit per head, in the denominator only (ggml's soft_max with sinks)
    sink = jnp.asarray(sinks, jnp.float32).reshape(1, c.kv_heads, group, 1, 1)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
  out = jnp.einsum("bkgts,bskh->btkgh", probs, values.astype(jnp.float32))
  return out.reshape(b, t, c.heads * c.head_dim)


def _explicit_mesh() -> bool:
  """Whether the mesh in context has Explicit axes (sharding in types)."""
  return bool(jax.sharding.get_abstract_mesh().explicit_axes)


def cache_on_mesh(cache: Any) -> Any:
  """On a mesh with Explicit axes, a cache made off the mesh (`init_cache`) as a replicated
  array on it, so that its updates can be typed (a no-op elsewhere)."""
  if not _explicit_mesh():
    return cache
  return jax.tree.map(
    lambda a: (
      jax.sharding.reshard(a, jax.sharding.PartitionSpec())
      if jax.typeof(a).sharding.mesh.empty
      else a
    ),
    cache,
  )


def _like_cache(update: jax.Array, cache: jax.Array) -> jax.Array:
  """A cache update in the cache's sharding on a mesh with Explicit axes (else as it is)."""
  if not _explicit_mesh() or jax.typeof(update).sharding.spec == jax.typeof(cache).sharding.spec:
    return update
  return jax.sharding.reshard(update, jax.typeof(cache).sharding.spec)


def _keep(old: jax.Array, new: jax.Array, keep: Any) -> jax.Array:
  """`new`, or `old` where the traced bool `keep` holds (a write that is a no-op)."""
  return new if keep is False else jnp.where(keep, old, new)


def _as_bits(x: jax.Array) -> jax.Array:
  """A 16-bit float array as its uint16 bits (a bitcast), else as it is."""
  if x.dtype in (jnp.bfloat16, jnp.float16):
    return jax.lax.bitcast_convert_type(x, jnp.uint16)
  return x


def _written(cache: jax.Array, new: jax.Array, write: Any) -> jax.Array:
  """`write(cache, new)` (a slice update) made on the arrays' bits: XLA:CPU updates a bfloat16
  array by converting the whole of it to float32 and back (for one layer's write, every
  layer's cache), and an integer array in place. The same bits either way."""
  out = write(_as_bits(cache), _as_bits(new))
  return jax.lax.bitcast_convert_type(out, cache.dtype) if out.dtype != cache.dtype else out


def _per_row(pos: Any) -> bool:
  """Whether `pos` holds one position per row ((B,)) rather than one for the batch."""
  return jnp.ndim(pos) == 1


def _row_write(pair, k, v, slot, cols, keep: Any = False):
  """Write k / v (B, n, KV, H) at columns `cols` (B, n) of each row of layer `slot` (a scatter;
  with `keep` traced, a no-op where it holds)."""
  rows = jnp.arange(k.shape[0])[:, None]
  out = []
  for cache, new in zip(pair, (k, v), strict=True):
    new = new.astype(cache.dtype)
    if keep is not False:
      new = _keep(cache[slot, rows, cols], new, keep)
    out.append(_written(cache, new, lambda c, n: c.at[slot, rows, cols].set(n)))
  return tuple(out)


def _global_write(pair, k, v, slot, pos, keep: Any = False):
  """Write the chunk k / v (B, T, KV, H) at `pos` (a scalar, or (B,) per row) of layer `slot`
  of a full cache."""
  if _per_row(pos):
    return _row_write(pair, k, v, slot, pos[:, None] + jnp.arange(k.shape[1]), keep)
  out = []
  at = (slot, 0, pos, 0, 0)
  for cache, new in zip(pair, (k, v), strict=True):
    new = _like_cache(new.astype(cache.dtype)[None], cache)
    if keep is not False:
      new = _keep(jax.lax.dynamic_slice(cache, at, new.shape), new, keep)
    out.append(_written(cache, new, lambda c, n: jax.lax.dynamic_update_slice(c, n, at)))
  return tuple(out)


READ_STEP = 1024
"""A chunk reads a cache row of S positions in lengths of whole `READ_STEP`s: S/8, S/4, S/2 or S."""


def read_lengths(s: int) -> tuple[int, ...]:
  """The key counts a chunk of several tokens at one position may read of a cache row of `s`
  positions, shortest first: s/8, s/4 and s/2 where they are whole multiples of `READ_STEP`, and
  s. The chunk reads the shortest that holds every key it sees (those before its last token's
  position, and its own), so its attention costs what the row holds, not the row's length; the
  keys past it are masked out in either case."""
  return tuple(s // d for d in (8, 4, 2) if s % (d * READ_STEP) == 0) + (s,)


def _global_read(c, q, pair, slot, pos, sinks=None):
  """Attend causally over layer `slot`'s cache (the chunk already written; a chunk of several
  tokens at one position reads the start `read_lengths` picks), with the heads' sink logits
  `sinks` (heads,) when given. One new token goes through
  `hooks.attend_one_token` (this XLA attention; under a q8rules provider, the
  decode-attention kernel where it runs, sinks included)."""

  def xla(call: AttentionCall) -> jax.Array:
    keys = jax.lax.dynamic_index_in_dim(call.keys, call.slot, 0, keepdims=False)  # (B, S, KV, H)
    values = jax.lax.dynamic_index_in_dim(call.values, call.slot, 0, keepdims=False)
    positions = jnp.asarray(call.pos)[..., None] + jnp.arange(call.q.shape[1])  # (T,) or (B, T)
    visible = jnp.arange(keys.shape[1]) <= positions[..., None]  # (T, S) or (B, T, S)
    lengths = read_lengths(keys.shape[1])
    if call.q.shape[1] == 1 or jnp.ndim(call.pos) or len(lengths) == 1:
      return _attend_f32(c, call.q, keys, values, visible, call.sinks)
    # A chunk at one position reads the shortest start of the row that holds every key it sees.
    shorter = jnp.sum(jnp.asarray(lengths[:-1]) <= positions[-1])

    def read(n: int, q, keys, values, visible, sinks) -> jax.Array:
      return _attend_f32(c, q, keys[:, :n], values[:, :n], visible[:, :n], sinks)

    branches = [functools.partial(read, n) for n in lengths]
    return jax.lax.switch(shorter, branches, call.q, keys, values, visible, call.sinks)

  how = AttentionParams.of(_scale(c), c.attn_softcap, xla)
  call = AttentionCall(q, pair[0], pair[1], slot, pos, how, sinks)
  out = hooks.attend_one_token(call) if q.shape[1] == 1 else xla(call)
  return out.astype(c.dtype)


def _local_read(c, q, k, v, pair, slot, pos, sinks=None):
  """Attend over layer `slot`'s ring (positions < pos) and the chunk, within the window (`pos`
  a scalar, or (B,) per row: then the masks are (B, T, R + T)); `sinks` as `_attend_f32`'s."""
  ring_k = jax.lax.dynamic_index_in_dim(pair[0], slot, 0, keepdims=False)  # (B, R, KV, H)
  ring_v = jax.lax.dynamic_index_in_dim(pair[1], slot, 0, keepdims=False)
  t, ring = k.shape[1], ring_k.shape[1]
  p = jnp.asarray(pos)[..., None]  # (1,) or (B, 1)
  # slot j holds the latest position < pos congruent to j mod R (negative: never written)
  ring_pos = p - 1 - jnp.mod(p - 1 - jnp.arange(ring), ring)
  positions = p + jnp.arange(t)
  key_pos = jnp.concatenate([ring_pos, positions], axis=-1)
  written = jnp.concatenate([ring_pos >= 0, jnp.ones(positions.shape, bool)], axis=-1)
  diff = positions[..., :, None] - key_pos[..., None, :]
  visible = written[..., None, :] & (diff >= 0) & (diff < c.sliding_window)
  keys = jnp.concatenate([ring_k, k.astype(ring_k.dtype)], axis=1)
  values = jnp.concatenate([ring_v, v.astype(ring_v.dtype)], axis=1)
  return _attend_f32(c, q, keys, values, visible, sinks).astype(c.dtype)


def _local_write(pair, k, v, slot, pos, keep: Any = False):
  """Write the chunk's last min(T, R) entries into layer `slot`'s ring (position p at p % R;
  `pos` a scalar, or (B,) per row)."""
  t, ring = k.shape[1], pair[0].shape[2]
  n = min(t, ring)
  if _per_row(pos):
    cols = jnp.mod(pos[:, None] + t - n + jnp.arange(n), ring)
    return _row_write(pair, k[:, t - n :], v[:, t - n :], slot, cols, keep)
  slots = jnp.mod(pos + t - n + jnp.arange(n), ring)
  out = []
  for cache, new in zip(pair, (k, v), strict=True):
    new = jnp.swapaxes(new[:, t - n :].astype(cache.dtype), 0, 1)  # (n, B, KV, H)
    if keep is not False:
      new = _keep(cache[slot, :, slots], new, keep)
    out.append(_written(cache, new, lambda c, n: c.at[slot, :, slots].set(n)))
  return tuple(out)


def attention(
  c: TransformerConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  groups: dict[str, Any],
  local: Any,
  slot: Any,
  pos: Any,
  sinks: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
  """q (B, T, heads, H), k / v (B, T, kv_heads, H) (RoPE applied) at `pos` for the layer at
  `slot` of its kind's cache -> (B, T, heads * H), the updated cache groups. `sinks` (heads,)
  float32: each head's sink logit in its softmax (None: none).

  `local` is a Python bool (unrolled layers, or a model with one kind of layer), or a traced
  bool (scanned layers of both kinds). Then the attention runs under `lax.cond` (only the
  layer's kind is computed; the caches go in read-only), and both caches are written with
  the other kind's write made a no-op (it writes back the T entries it read), so no
  branch carries a whole cache: shapes stay uniform across the scan without copies.

  One new token (T = 1) is written into its ring before it is read, as a full cache is: the
  entry it replaces (position pos - R) is one the window no longer sees, so the ring then
  holds exactly the visible keys, in slots [0, min(pos + 1, R)), and is read as a full cache
  (`_global_read`: the decode-attention kernel where it runs). Reading a ring before writing
  it made XLA copy every layer's ring of the scan twice per layer (the read is not an input
  of the write, so it could not be ordered before an in-place update).
  """
  kinds = c.layer_kinds
  one = q.shape[1] == 1
  if len(kinds) == 1 or isinstance(local, bool):
    if kinds == ("local",) or local is True:
      if one:
        ring = _local_write(groups["local"], k, v, slot, pos)
        return _global_read(c, q, ring, slot, pos, sinks), {**groups, "local": ring}
      out = _local_read(c, q, k, v, groups["local"], slot, pos, sinks)
      return out, {**groups, "local": _local_write(groups["local"], k, v, slot, pos)}
    pair = _global_write(groups["global"], k, v, slot, pos)
    return _global_read(c, q, pair, slot, pos, sinks), {**groups, "global": pair}
  glob = _global_write(groups["global"], k, v, slot, pos, keep=local)
  if one:
    loc = _local_write(groups["local"], k, v, slot, pos, keep=jnp.logical_not(local))
    out = jax.lax.cond(
      local,
      lambda: _global_read(c, q, loc, slot, pos, sinks),
      lambda: _global_read(c, q, glob, slot, pos, sinks),
    )
    return out, {"global": glob, "local": loc}
  out = jax.lax.cond(
    local,
    lambda: _local_read(c, q, k, v, groups["local"], slot, pos, sinks),
    lambda: _global_read(c, q, glob, slot, pos, sinks),
  )
  loc = _local_write(groups["local"], k, v, slot, pos, keep=jnp.logical_not(local))
  return out, {"global": glob, "local": loc}


PENDING = "pending_local"
"""The key under which the new K and V of a local layer whose KV later layers share wait in the
cache groups, until `write_pending` writes them into its ring after the last layer."""


def attention_deferred(
  c: TransformerConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  groups: dict[str, Any],
  slot: int,
  pos: Any,
) -> tuple[jax.Array, dict[str, Any]]:
  """A local layer whose KV later layers share (`TransformerConfig.shared_kv_layers`): its
  attention as `attention`'s, but its ring is left as it was and k / v (B, T, kv_heads, H) wait
  under `PENDING`, so that each sharing layer reads what this one read (a chunk longer than one
  token would overwrite ring entries its first queries still see)."""
  out = _local_read(c, q, k, v, groups["local"], slot, pos)
  return out, {**groups, PENDING: (k, v)}


def attention_shared(
  c: TransformerConfig, q: jax.Array, groups: dict[str, Any], local: bool, slot: int, pos: Any
) -> jax.Array:
  """q (B, T, heads, H) of a layer that computes no KV, over the KV of its source layer at
  `slot` (already written: a global layer's; waiting under `PENDING`: a local one's) ->
  (B, T, heads * H), as the source attends."""
  if local:
    k, v = groups[PENDING]
    return _local_read(c, q, k, v, groups["local"], slot, pos)
  return _global_read(c, q, groups["global"], slot, pos)


def write_pending(groups: dict[str, Any], slot: int, pos: Any) -> dict[str, Any]:
  """The cache groups with the K and V waiting under `PENDING` written into layer `slot` of the
  local ring (as `attention` writes them), and the key gone."""
  if PENDING not in groups:
    return groups
  rest = {k: v for k, v in groups.items() if k != PENDING}
  return {**rest, "local": _local_write(groups["local"], *groups[PENDING], slot, pos)}


__all__ = [
  "PENDING",
  "Cache",
  "apply_rope",
  "as_groups",
  "attention",
  "attention_deferred",
  "attention_shared",
  "check_cache",
  "from_groups",
  "init_cache",
  "rope_angles",
  "rope_mscale",
  "write_pending",
]
