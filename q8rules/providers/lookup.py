"""Embedding lookups (`jnp.take` of a 2-D table's rows or columns) under the Q8 providers.

An embedding table is read two ways: looked up (`jnp.take(table, ids, axis)`)
and, with tied embeddings, as the output projection's weight. Both must read
the same values, and the table should be stored once. So a rule that matches
the lookup (op name 'take'; `Q8Rule()`'s empty `op_names` matches every op)
serves the table as Q8_0 with the layout the tied product uses: the table's
other axis is K (blocked by 32), the looked-up axis is N. A lookup gathers the
looked-up columns of the int8 values and their scales and dequantises just
those, so no float copy of the table exists. QAT reads the looked-up entries
of the table's Q8_0 round trip (straight-through gradient), so the served
model computes with exactly what QAT trained against. To keep a table float,
give its module a rule whose `op_names` leaves 'take' out.

This module owns how a lookup reads Q8_0 values (its layout, `take_q8`, the options it
honours, its report fields); `q8rules.providers.policy`'s modes decide, per run, whether a lookup
(`jnp.take`, or `table[ids]`) is served, fake-quantised or left float.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from q8rules.layout import UnsupportedProduct, WeightLayout
from q8rules.q8_0 import BLOCK, Q8Array, dequantize

OP = "take"
"""The op name rules match lookups by."""

PATH = "lookup"
"""The `OpRecord.path` of a lookup served from Q8_0 values."""


class UnsupportedLookup(UnsupportedProduct):
  """A `jnp.take` the providers do not serve from Q8_0 (it runs float, or is refused)."""


def lookup_layout(shape: tuple[int, ...], axis: Any) -> WeightLayout:
  """The (K, N) layout of a 2-D table looked up along `axis` (0 or 1; -2 or -1 alike)."""
  if len(shape) != 2:
    raise UnsupportedLookup(f"a lookup in a {len(shape)}-D table (only 2-D tables are served)")
  if not isinstance(axis, int) or axis not in (0, 1, -1, -2):
    raise UnsupportedLookup(f"a lookup along axis={axis!r} (only 0 or 1 of a 2-D table)")
  axis %= 2
  return WeightLayout(tuple(shape), contract=(1 - axis,), free=(axis,))


def check_lookup_kwargs(kwargs: dict[str, Any]) -> None:
  """Refuse `jnp.take` options a Q8 lookup does not honour (out-of-range modes aside)."""
  unsupported = {k: v for k, v in kwargs.items() if v is not None and k not in ("mode",)}
  if unsupported:
    raise UnsupportedLookup(f"jnp.take options {sorted(unsupported)} on a Q8_0 table")


def indexing_ids(ids: Any, n: int) -> jax.Array:
  """Ids into an axis of `n` entries as `table[ids]` reads them (negative ids count from the end;
  out-of-range ids are clamped, as JAX's gather clamps): for `take_q8(..., mode='clip')`."""
  ids = jnp.asarray(ids)
  return jnp.where(ids < 0, ids + n, ids)


def take_q8(
  weight: Q8Array, layout: WeightLayout, ids: jax.Array, dtype: Any, mode: str | None = None
) -> jax.Array:
  """`jnp.take(table, ids, axis, mode=mode)` of the table `layout` describes, from its Q8_0 form.

  Args:
    weight: the table as a (K_padded, N) Q8Array (q int8, scale (K_padded/32, N)).
    layout: `lookup_layout(table.shape, axis)`.
    ids: integer indices into the looked-up axis (any shape).
    dtype: the float dtype of the result (the table's own).
    mode: as `jnp.take`'s: None or 'fill' counts a negative id from the end and gives
      NaN for one out of range, 'clip' clamps every id into [0, N), 'wrap' wraps it.

  Returns:
    (K, *ids.shape) for a lookup along axis 1, (*ids.shape, K) along axis 0, in `dtype`.
  """
  flat = jnp.ravel(ids)
  n = layout.n
  if mode == "wrap":
    flat = jnp.mod(flat, n)
  inside = (flat >= -n) & (flat < n)
  if mode != "clip":  # as jnp.take: negative ids count from the end, except when clipping
    flat = jnp.where(flat < 0, flat + n, flat)
  flat = jnp.clip(flat, 0, n - 1)
  cols = Q8Array(jnp.take(weight.q, flat, axis=1), jnp.take(weight.scale, flat, axis=1))
  values = dequantize(cols)[: layout.k]
  if mode in (None, "fill"):
    values = jnp.where(inside[None, :], values, jnp.nan)
  values = values.astype(dtype).reshape(layout.k, *jnp.shape(ids))
  return values if layout.free == (1,) else jnp.moveaxis(values, 0, -1)


def record_fields(
  layout: WeightLayout, indices: Any, scale_itemsize: int, float_itemsize: int
) -> dict[str, Any]:
  """The `OpRecord` fields of a lookup of `indices`: its table's shape, M x K x N (M the entries
  looked up), and the bytes it reads as float and as Q8_0 (int8 values and their scales)."""
  rows = math.prod(jnp.shape(indices))
  k_pad = layout.k_padded
  return dict(
    weight_shape=layout.shape,
    m=rows,
    k=layout.k,
    n=layout.n,
    float_bytes=rows * layout.k * float_itemsize,
    q8_bytes=rows * (k_pad + (k_pad // BLOCK) * scale_itemsize),
  )


__all__ = [
  "OP",
  "PATH",
  "UnsupportedLookup",
  "check_lookup_kwargs",
  "indexing_ids",
  "lookup_layout",
  "record_fields",
  "take_q8",
]
