"""Embedding lookups (`jnp.take`) under the Q8 providers: the table stored once, as Q8_0."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import q8rules
from q8rules.layout import WeightLayout
from q8rules.providers.lookup import UnsupportedLookup, lookup_layout, take_q8
from tests._utils import rel_err


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("mode", [None, "clip", "wrap"])
def test_take_q8_is_the_dequantised_tables_take(axis, mode):
  """Against float64: the looked-up entries of the dequantised table, in jnp.take's layout, for
  lookups along either axis, K padded (40 -> 64), out-of-range ids as jnp.take's mode says."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((40, 24) if axis % 2 == 1 else (24, 40)).astype(np.float32)
  layout = lookup_layout(table.shape, axis)
  q8 = q8rules.quantize(layout.to_matrix(jnp.asarray(table)))
  deq64 = np.asarray(layout.from_matrix(q8rules.dequantize(q8)), np.float64)
  ids = rng.integers(0, layout.n, (3, 5))
  ids[0, 0] = layout.n + 2 if mode else ids[0, 0]  # out of range: clipped or wrapped
  ids[1, 1] = -1  # from the end, or clipped to 0
  got = take_q8(q8, layout, jnp.asarray(ids), jnp.float32, mode)
  n = layout.n
  picked = {
    "clip": np.clip(ids, 0, n - 1),
    "wrap": np.mod(ids, n),
    None: np.where(ids < 0, ids + n, ids),
  }
  want = np.take(deq64, picked[mode], axis=axis)
  assert got.shape == want.shape and got.dtype == jnp.float32
  assert rel_err(got, want) < 1e-7


def test_take_q8_fills_nan_out_of_range():
  layout = WeightLayout((32, 4), contract=(0,), free=(1,))
  q8 = q8rules.quantize(jnp.ones((32, 4)))
  got = take_q8(q8, layout, jnp.asarray([0, 4, -5]), jnp.float32)
  assert np.all(np.isfinite(got[:, 0])) and np.all(np.isnan(got[:, 1:]))


def test_unsupported_lookups_are_named():
  with pytest.raises(UnsupportedLookup, match="3-D"):
    lookup_layout((2, 3, 4), 0)
  with pytest.raises(UnsupportedLookup, match="axis=None"):
    lookup_layout((2, 3), None)


class Tied(nn.Module):
  """A lookup and a tied head on one (dim, vocab) table, as `q8rules.models.Embed`."""

  @nn.compact
  def __call__(self, ids):
    table = self.param("table", nn.initializers.normal(1.0), (64, 48), jnp.float32)
    x = jnp.moveaxis(jnp.take(table, ids, axis=1), 0, -1)  # (B, T, 64)
    return jnp.dot(jnp.tanh(x), table)


def test_tied_table_stored_once_and_served_alike():
  """One Q8 param serves the lookup and the head; eager, jit and QAT agree; `op_names`
  without 'take' keeps a table float for the lookup."""
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 48, (2, 5)), jnp.int32)
  model = Tied()
  float_params = model.init(jax.random.key(0), ids)["params"]
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8_model = qwix.quantize_model(model, provider)
  abstract = jax.eval_shape(q8_model.init, jax.random.key(0), ids)["params"]
  q8_params = q8rules.quantize_params(float_params, abstract)
  table = q8_params["table"].array
  assert table.q.shape == (64, 48) and table.q.dtype == jnp.int8  # one copy, as Q8_0
  served = q8_model.apply({"params": q8_params}, ids)
  assert rel_err(jax.jit(q8_model.apply)({"params": q8_params}, ids), served) < 1e-6
  deq = np.asarray(q8rules.dequantize(table), np.float64)
  x = np.tanh(np.moveaxis(np.take(deq, np.asarray(ids), axis=1), 0, -1))
  assert rel_err(served, x @ deq) < 1e-5
  paths = provider.report().paths()
  assert paths["/take0"] == "lookup" and paths["/dot_general0"] != "float"
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider([q8rules.Q8Rule()]))
  assert rel_err(jax.jit(qat.apply)({"params": float_params}, ids), served) < 1e-5

  keep_float = q8rules.Q8Provider([q8rules.Q8Rule(op_names=("dot_general",))])
  float_lookup = qwix.quantize_model(model, keep_float)
  float_lookup.init(jax.random.key(0), ids)
  assert keep_float.report().paths()["/take0"] == "float"


class Table3D(nn.Module):
  @nn.compact
  def __call__(self, ids):
    table = self.param("table", nn.initializers.normal(1.0), (8, 4, 32), jnp.float32)
    return jnp.take(table, ids, axis=0)


def test_a_lookup_in_a_3d_table_runs_float_with_a_warning(rng):
  """Only 2-D tables are served from Q8_0: another lookup stays float, warned and recorded."""
  ids = jnp.asarray(rng.integers(0, 8, (3,)), jnp.int32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8_model = qwix.quantize_model(Table3D(), provider)
  with pytest.warns(UserWarning, match=r"/take0: left float: a lookup in a 3-D table"):
    params = q8_model.init(jax.random.key(0), ids)["params"]
  assert isinstance(params["table"], jax.Array) and params["table"].dtype == jnp.float32
  assert provider.report().paths() == {"/take0": "float"}
  out = q8_model.apply({"params": params}, ids)
  assert np.array_equal(np.asarray(out), np.asarray(params["table"])[np.asarray(ids)])
