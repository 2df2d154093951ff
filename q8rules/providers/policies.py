"""What the providers do with a weight `tracking` found, decided per run: serve it as Q8_0,
fake-quantise it, or leave it float.

One policy in every mode (eager, `jit`, `eval_shape`, `grad`; serving and QAT), decided
from what the current run has seen, never from an earlier run:

  * A product whose weight is a param, or a param after `astype` / `.T` / `transpose` /
    `reshape`, quantizes the param itself, in its own shape and dtype (what
    `quantize_params` quantizes), stores it, and serves the view from it. QAT
    fake-quantises the param and applies the same ops.
  * A lookup (`jnp.take`, `table[ids]`) of a param a rule matches (op name 'take') stores
    the table as Q8_0 with the looked-up axis as N and reads the looked-up columns
    (`q8rules.providers.lookup`, which owns how a lookup reads Q8_0 values); QAT
    fake-quantises the table, then looks it up. A tied head (`x @ E.T`) then serves its
    product from the same stored values: one copy, the lookup and the head agree.
  * A lookup no rule matches, or of a float table given to a linen model's `apply`, runs
    float, and a later product on that param in the same run stays float too (the tied head
    kept float: `Q8Rule(op_names=('dot_general', 'einsum'))` on the embedder). A param
    already stored as Q8_0 (or fake-quantised this run) is always looked up from its Q8_0
    values.

A forward pass after the first never stores a param: every later run finds the Q8 params
the first stored.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from q8rules._qwix import (
  current_module_path,
  current_rule_and_op_id,
  find_param,
  get_current_module,
  module_params,
  unbox,
)
from q8rules.layout import Q8How, WeightLayout
from q8rules.providers import lookup, q8_weight, views
from q8rules.providers.placement import annotation, install, stored_layout
from q8rules.providers.q8_weight import Q8Weight, as_q8_weight
from q8rules.providers.tracking import Derived
from q8rules.q8_0 import Q8Array
from q8rules.rules import Q8Rule

Quantizer = Callable[[jax.Array, Q8How, str], Q8Array]
FakeQuant = Callable[[jax.Array, WeightLayout, str], jax.Array]
RunOn = Callable[[Any], jax.Array]

FAKE_QUANT = "fake_quant"
"""The `OpRecord.path` of a fake-quantised product or lookup."""


def operand(provider: Any, rhs: Any) -> tuple[Derived | None, str]:
  """The param a float operand is (exactly, or through recorded ops; else by Qwix's own
  heuristics), or None and why the product stays float."""
  run = provider._run
  found = run.find(rhs)
  if found is None:  # Qwix's own search: through any unary op when traced, or by shape
    name = find_param(rhs)
    if not name:
      return None, "operand is not a weight"
    module = get_current_module()
    param = unbox(module_params(module)[name])
    if tuple(param.shape) != tuple(rhs.shape):  # eagerly it would not be found: the same here
      return None, (
        f"derives from {name} through an op q8rules does not carry (astype, .T, transpose,"
        " reshape and Flax's dtype promotion are carried): left float"
      )
    found = Derived(module, name, rhs)
  if found.key in run.float_lookups:
    return None, (
      f"{found.name} was looked up float in this run (no rule matched the lookup): the tied"
      " product stays float"
    )
  return found, ""


def _base(found: Derived, view: WeightLayout) -> WeightLayout:
  """The param's own layout for the product (or lookup) layout `view` of `found`."""
  try:
    return views.base_layout(view, found.chain, found.shapes)
  except views.ViewError as e:
    raise ValueError(f"{found.name}: {views.describe(found.chain)}: {e}") from None


def stored_how(found: Derived, view: WeightLayout, scale_dtype: str) -> Q8How:
  """How the param of `found` is stored as Q8_0 for a product (or lookup) of layout `view` of
  it: the param's own layout (an annotated split of a free axis moved to the front of N), its
  scale dtype and float dtype."""
  box = module_params(found.module)[found.name]
  layout = stored_layout(_base(found, view), found.chain, annotation(box))
  return Q8How(layout, scale_dtype, np.dtype(found.base.dtype).name)


def _stored(
  provider: Any, found: Derived, view: WeightLayout, rule: Q8Rule | None, q: Quantizer
) -> Q8Weight:
  """The param of `found` stored as Q8_0 (now, or earlier this run), as the view `found` is
  (of layout `view`)."""
  box = module_params(found.module)[found.name]
  weight = as_q8_weight(box)
  if weight is None:
    if rule is None:
      raise ValueError(f"{found.name}: no rule for a weight that is not stored as Q8_0")
    how = stored_how(found, view, np.dtype(rule.scale_dtype).name)
    weight = install(found.module, found.name, found.base, how, q)
    # the model still holds the float value it read (a tied table's head after its lookup)
    base = found.base
    provider._run.derived.setdefault(
      id(base), (dataclasses.replace(found, chain=(), shapes=()), base)
    )
  provider._run.weights[found.key] = weight.how.scale_dtype
  for op in found.chain:
    weight = weight.view(op)
  return weight


def _lookup_layout(provider: Any, rule: Q8Rule | None, op_id: str, shape: Any, axis: int):
  """The table's lookup layout, or None (recorded float, with a warning) when a lookup in it
  is not served from Q8_0 (`lookup.lookup_layout`: 2-D tables only)."""
  try:
    return lookup.lookup_layout(tuple(shape), axis)
  except lookup.UnsupportedLookup as e:
    where = f"{current_module_path() or '(top module)'}/{op_id}"
    warnings.warn(f"{where}: left float: {e}", stacklevel=5)
    provider._record(rule, op_id, "float", weight_shape=tuple(shape), note=f"left float: {e}")
    return None


def _as_float(
  provider: Any, found: Derived, rule: Any, op_id: str, arr: jax.Array, note: str, run_on: RunOn
) -> jax.Array:
  """A lookup left float (recorded with `note`): the param's products stay float this run."""
  provider._run.float_lookups.add(found.key)
  provider._record(rule, op_id, "float", weight_shape=tuple(arr.shape), note=note)
  return run_on(arr)


def record_lookup(
  provider: Any,
  rule: Q8Rule | None,
  op_id: str,
  path: str,
  layout: WeightLayout,
  ids: Any,
  dtypes: tuple[Any, Any],
  note: str,
) -> None:
  """Put a lookup in the provider's report (path 'lookup', 'fake_quant' or 'float'); `dtypes`:
  the table's scale dtype and float dtype."""
  scale, dtype = (np.dtype(d).itemsize for d in dtypes)
  provider._record(rule, op_id, path, note=note, **lookup.record_fields(layout, ids, scale, dtype))


def _looked_up_note(name: str) -> str:
  return f"lookup of {name or 'the table'}: the entries' Q8_0 values, dequantised"


# ---- serving -----------------------------------------------------------------


def serve_operand(
  provider: Any, rule: Q8Rule, found: Derived, view: WeightLayout, q: Quantizer
) -> Q8Weight:
  """The float operand `found` of a matched product (layout `view`) as the Q8 view to serve:
  its param stored as Q8_0 (its sharding annotation carried over), the operand's ops applied."""
  return _stored(provider, found, view, rule, q)


def serve_lookup(provider: Any, q: Quantizer) -> Callable[..., jax.Array]:
  """The serving `tracking.LookupPolicy`: a matched table is stored as Q8_0 and looked up."""

  def policy(found: Derived, arr: jax.Array, ids: Any, axis: int, mode: Any, run_on: RunOn):
    rule, op_id = current_rule_and_op_id(provider, lookup.OP)
    given_float = isinstance(found.module, nn.Module) and not found.module.is_initializing()
    if rule is None or given_float:  # no rule, or a linen apply given a float table: float
      note = "lookup: no rule matched" if rule is None else "lookup: the table was given float"
      return _as_float(provider, found, rule, op_id, arr, note, run_on)
    layout = _lookup_layout(provider, rule, op_id, arr.shape, axis)
    if layout is None:
      return run_on(arr)
    table = _stored(provider, found, layout, rule, q)
    return _q8_lookup(provider, rule, op_id, table, ids, axis, mode)

  return policy


def _q8_lookup(
  provider: Any, rule: Any, op_id: str, table: Q8Weight, ids: Any, axis: int, mode: Any
) -> jax.Array:
  out = q8_weight.lookup(table, ids, axis, mode)
  dtypes = (table.array.scale.dtype, table.dtype)
  note = _looked_up_note(table.name)
  record_lookup(provider, rule, op_id, lookup.PATH, table.how.layout, ids, dtypes, note)
  return out


def q8_lookup(provider: Any) -> Callable[[Q8Weight, Any, int, Any], jax.Array]:
  """A lookup of a stored Q8 table (any rule): gathered from its Q8_0 values, recorded."""

  def run(table: Q8Weight, ids: Any, axis: int, mode: Any = None) -> jax.Array:
    rule, op_id = current_rule_and_op_id(provider, lookup.OP)
    return _q8_lookup(provider, rule, op_id, table, ids, axis, mode)

  return run


# ---- QAT ---------------------------------------------------------------------


def fake_quant_operand(
  found: Derived, base: jax.Array, view: WeightLayout, scale_dtype: str, fq: FakeQuant
) -> jax.Array:
  """The fake-quantised operand of a matched product whose weight is `found` (of layout `view`)
  with the param's value `base`: the param's Q8_0 round trip, then the operand's ops (what
  serving computes with)."""
  return _round_trip(found, views.apply(found.chain, base), view, scale_dtype, fq, base=base)


def _narrows(found: Derived) -> bool:
  """Whether the ops cast the param to a narrower float (float32 -> bfloat16)."""
  size = np.dtype(found.base.dtype).itemsize
  for op in found.chain:
    if isinstance(op, views.AsType):
      if np.dtype(op.dtype).itemsize < size:
        return True
      size = np.dtype(op.dtype).itemsize
  return False


def _round_trip(
  found: Derived,
  value: jax.Array,
  view: WeightLayout,
  scale_dtype: str,
  fq: FakeQuant,
  *,
  base: jax.Array | None = None,
) -> jax.Array:
  """The Q8_0 round trip of `value` = ops(param), of layout `view`, as serving computes with it.

  Transposes, reshapes and widening casts leave the values (hence the blocks) as they are, so
  the round trip of `value` itself is the served one. After a narrowing cast the served
  values come from the param's own (wider) values (`base`, by default `found.base`): the
  param's round trip, then the ops that move values (the casts left out: `fq` gives the
  values in the dtype serving computes in, and the product's result is cast as serving
  casts it).
  """
  if not _narrows(found):
    return fq(value, view, scale_dtype)
  moves = tuple(op for op in found.chain if not isinstance(op, views.AsType))
  base = found.base if base is None else base
  return views.apply(moves, fq(base, _base(found, view), scale_dtype))


def fake_quant_lookup(provider: Any, fq: FakeQuant) -> Callable[..., jax.Array]:
  """The QAT `tracking.LookupPolicy`: a matched table (or one fake-quantised as a weight this
  run) is fake-quantised, then looked up by the model's own op."""

  def policy(found: Derived, arr: jax.Array, ids: Any, axis: int, mode: Any, run_on: RunOn):
    rule, op_id = current_rule_and_op_id(provider, lookup.OP)
    scale_dtype = provider._run.weights.get(found.key)
    if rule is not None:
      scale_dtype = np.dtype(rule.scale_dtype).name
    if scale_dtype is None:
      return _as_float(provider, found, rule, op_id, arr, "lookup: no rule matched", run_on)
    layout = _lookup_layout(provider, rule, op_id, arr.shape, axis)
    if layout is None:
      return run_on(arr)
    table = _round_trip(found, arr, layout, scale_dtype, fq)
    note = f"lookup of {found.name}: the entries of its Q8_0 round trip"
    record_lookup(provider, rule, op_id, FAKE_QUANT, layout, ids, (scale_dtype, arr.dtype), note)
    return run_on(table).astype(arr.dtype)  # as `take_q8`: the entries in the table's dtype

  return policy


def refuse_q8_lookup(table: Q8Weight, ids: Any, axis: int, mode: Any = None) -> jax.Array:
  """QAT's lookup of a Q8 (serving) table: refused, as its products refuse Q8 weights."""
  raise TypeError(
    f"{table.name or 'a Q8_0 table'}: got a Q8 (serving) table; Q8QatProvider trains float"
    " params. Run Q8 params with the Q8Provider model, and QAT with the float params."
  )


def weight_note(weight: Any, k: int, k_pad: int) -> str:
  """The report's note on a served product: K padding, and the param a view is of."""
  notes = [f"K padded {k} -> {k_pad}"] if k_pad != k else []
  if isinstance(weight, Q8Weight) and weight.chain:
    notes.append(f"weight {weight.name} as {views.describe(weight.chain)}")
  return "; ".join(notes)


__all__ = [
  "FAKE_QUANT",
  "fake_quant_lookup",
  "fake_quant_operand",
  "operand",
  "q8_lookup",
  "record_lookup",
  "refuse_q8_lookup",
  "serve_lookup",
  "serve_operand",
  "stored_how",
  "weight_note",
]
