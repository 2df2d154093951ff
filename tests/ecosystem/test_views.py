"""Weights used through astype / .T / reshape, and tied embeddings, on a small nnx model.

The model (`Ops`) looks a table up, then multiplies by a bfloat16 weight cast to float32, a
weight transposed (`h @ b.T`), one reshaped (64, 2, 32) -> (64, 64), and the table again as
its tied head (`z @ E.T`). Every product is checked against float64 numpy on the weights'
exact Q8_0 round trips, in every mode: eager, `nnx.jit`, `quantize_params`, QAT.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules.layout import WeightLayout
from q8rules.providers.q8_weight import Q8Weight
from tests._utils import rel_err
from tests.ecosystem.reference import dense_layout, round_trip64, rows_layout

VOCAB, DIM, HID = 128, 64, 96


class Ops(nnx.Module):
  """ids (B, T) -> logits (B, T, VOCAB), each weight reaching its product through an op."""

  def __init__(self, rng: np.random.Generator):
    def w(*shape: int, dtype=jnp.float32) -> nnx.Param:
      v = rng.standard_normal(shape) / np.sqrt(shape[0])
      return nnx.Param(jnp.asarray(v.astype(np.float32)).astype(dtype))

    self.emb = w(VOCAB, DIM)
    self.a = w(DIM, HID, dtype=jnp.bfloat16)  # cast to float32 where it is used
    self.b = w(DIM, HID)  # used transposed: (HID, DIM)
    self.c = w(DIM, 2, DIM // 2)  # used reshaped: (DIM, DIM)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.emb[(ids,)]
    h = jnp.tanh(jnp.dot(x, jnp.astype(self.a[...], jnp.float32)))
    y = jnp.dot(h, self.b[...].T)
    z = jnp.dot(y, self.c[...].reshape(DIM, DIM))
    return jnp.dot(z, self.emb[...].T)


def reference64(model: Ops, ids: np.ndarray) -> np.ndarray:
  """The served model in float64: every weight replaced by its Q8_0 round trip."""
  emb = round_trip64(model.emb[...], rows_layout((VOCAB, DIM)))
  a = round_trip64(model.a[...], dense_layout((DIM, HID)))
  b = round_trip64(model.b[...], WeightLayout((DIM, HID), (1,), (0,)))  # K: the view's rows
  c = round_trip64(model.c[...], dense_layout((DIM, 2, DIM // 2)))
  x = emb[ids]
  h = np.tanh(x @ a)
  z = (h @ b.T) @ c.reshape(DIM, DIM)
  return z @ emb.T


def _bytes(model: nnx.Module) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(model))]


@pytest.fixture(scope="module")
def served():
  rng = np.random.default_rng(19)
  ids = jnp.asarray(rng.integers(0, VOCAB, (2, 5)), jnp.int32)
  model = Ops(rng)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8 = qwix.quantize_model(model, provider, ids)
  return model, q8, provider, ids


def test_every_product_against_float64(served):
  model, q8, _, ids = served
  ref = reference64(model, np.asarray(ids))
  assert rel_err(q8(ids), ref) <= 1e-5
  assert rel_err(nnx.jit(lambda m, i: m(i))(q8, ids), ref) <= 1e-5


def test_params_are_stored_once_in_their_own_shape(served):
  model, q8, _, _ = served
  for name, contract in (("emb", (1,)), ("a", (0,)), ("b", (1,)), ("c", (0,))):
    p = getattr(q8, name)
    assert isinstance(p, Q8Weight) and p.name == name and not p.chain
    assert p.shape == getattr(model, name)[...].shape and p.how.layout.contract == contract
  assert q8.a.how.dtype == "bfloat16"  # the param's dtype, not the cast's


def test_report_lists_every_product_and_the_tied_head(served):
  _, q8, provider, ids = served
  q8(ids)
  ops = {r.op: r for r in provider.report().ops}
  assert ops["take0"].path == "lookup"
  products = [ops[f"dot_general{i}"] for i in range(4)]
  assert all(r.path not in ("float", "lookup") for r in products)
  assert "b as transpose(1, 0)" in products[1].note
  assert "c as reshape(64, 64)" in products[2].note
  assert "emb as transpose(1, 0)" in products[3].note and products[3].n == VOCAB


def test_no_forward_rewrites_a_param(served):
  _, q8, _, ids = served
  before = _bytes(q8)
  eager = q8(ids)
  jitted = nnx.jit(lambda m, i: m(i))(q8, ids)
  assert _bytes(q8) == before
  assert rel_err(jitted, eager) <= 1e-6


def test_quantize_params_equals_init_time(served):
  model, q8, _, _ = served
  converted = q8rules.quantize_params(nnx.state(model, nnx.Param), q8)
  init_time = nnx.to_pure_dict(nnx.state(q8, nnx.Param))
  for got, want in zip(jax.tree.leaves(converted), jax.tree.leaves(init_time), strict=True):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.slow
def test_qat_forward_equals_served_and_trains(served):
  model, q8, _, ids = served
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider([q8rules.Q8Rule()]), ids)
  want = q8(ids)
  assert rel_err(qat(ids), want) <= 1e-5
  assert rel_err(nnx.jit(lambda m, i: m(i))(qat, ids), want) <= 1e-5

  def loss(m: nnx.Module) -> jax.Array:
    return jnp.mean(m(ids) ** 2)

  g = jax.tree.leaves(nnx.jit(nnx.grad(loss))(qat))
  g_float = jax.tree.leaves(nnx.grad(loss)(model))
  flat = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in g])
  flat_f = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in g_float])
  assert np.isfinite(flat).all()
  assert flat @ flat_f / np.linalg.norm(flat) / np.linalg.norm(flat_f) >= 0.99


def test_tables_kept_float_keep_the_tied_head_float(served):
  model, _, _, ids = served
  rules = [q8rules.Q8Rule(op_names=("dot_general",))]
  provider = q8rules.Q8Provider(rules)
  q8 = qwix.quantize_model(model, provider, ids)
  assert isinstance(q8.emb, nnx.Param)
  ops = {r.op: r for r in provider.report().ops}
  assert ops["take0"].path == "float" and ops["dot_general3"].path == "float"
  assert "looked up float" in ops["dot_general3"].note
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider(rules), ids)
  assert rel_err(nnx.jit(lambda m, i: m(i))(qat, ids), q8(ids)) <= 1e-5


def test_other_uses_of_a_q8_weight_name_it(served):
  _, q8, _, _ = served
  b = q8.b[...]
  with pytest.raises(TypeError, match=r"Q8_0 weight b of float shape \(64, 96\).*operator \+"):
    b + 2.0
  with pytest.raises(TypeError, match=r"Q8_0 weight b .*contracted axes \(1,\) \(K\)"):
    b * jnp.ones(96)  # b is stored with K its last axis: a factor along N is served, not one on K
  assert (b * jnp.ones((64, 1))).chain[-1].columns.shape == (64,)
  with pytest.raises(TypeError, match=r"Q8_0 weight b .*operator \* with str"):
    b * "2"
  with pytest.raises(TypeError, match=r"Q8_0 weight b .*converting it to an array"):
    jnp.sin(b)
  with pytest.raises(TypeError, match=r"Q8_0 weight b .*indexing with slice"):
    b[1:3]
  with pytest.raises(TypeError, match=r"Q8_0 weight c .*does not keep the Q8_0 matrix"):
    q8.c[...].reshape(2 * DIM, DIM // 2)
  with pytest.raises(TypeError, match=r"Q8_0 weight emb .*lookup along axis 1"):
    q8.emb[...].take(jnp.zeros((2,), jnp.int32), axis=1)


class Swapped(nnx.Module):
  """A weight used directly, then through `jnp.swapaxes` (an op q8rules does not carry)."""

  def __init__(self, rng: np.random.Generator):
    self.w = nnx.Param(jnp.asarray(rng.standard_normal((DIM, DIM)).astype(np.float32)))

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.dot(jnp.dot(x, self.w[...]), jnp.swapaxes(self.w[...], 0, 1))


def test_an_op_not_carried_on_a_q8_weight_names_it(rng):
  x = jnp.asarray(rng.standard_normal((2, DIM)).astype(np.float32))
  with pytest.raises(TypeError, match=r"Q8_0 weight w of float shape \(64, 64\)"):
    qwix.quantize_model(Swapped(rng), q8rules.Q8Provider([q8rules.Q8Rule()]), x)


def test_lookups_equal_the_round_trip_rows(served):
  model, q8, _, _ = served
  ids = jnp.asarray([[0, VOCAB - 1, -1], [5, 5, 200]], jnp.int32)  # -1: the last; 200: clipped
  got = np.asarray(q8.emb[(ids,)], np.float64)
  table = round_trip64(model.emb[...], rows_layout((VOCAB, DIM)))
  want = table[np.clip(np.where(ids < 0, ids + VOCAB, ids), 0, VOCAB - 1)]
  assert np.array_equal(got, want.astype(np.float32))
