"""Tied embeddings in linen, through every README flow.

Two heads on the embedding table: Gemma's linen `Embedder` (`table[(ids,)]`, then
`jnp.dot(x, table.T)`) and Flax's own `nn.Embed.attend`. The table is stored once as Q8_0
(K = the embedding width), the lookup dequantises the looked-up rows and the head is served
from the same values, whether the Q8 params come from `init`, from `jax.eval_shape(init)` +
`quantize_params`, or are run under `jax.jit`; QAT computes the same forward pass.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import q8rules
from tests._utils import rel_err
from tests.ecosystem.reference import dense_layout, round_trip64, rows_layout

VOCAB, DIM, HID = 256, 64, 128


class GemmaEmbedder(nn.Module):
  """Gemma's linen embedder: the table (vocab, dim) looked up and used as the head."""

  def setup(self):
    self.input_embedding = self.param("input_embedding", nn.initializers.normal(1.0), (VOCAB, DIM))

  def encode(self, ids: jax.Array) -> jax.Array:
    return self.input_embedding[(ids,)] * jnp.sqrt(DIM).astype(jnp.float32)

  def decode(self, x: jax.Array) -> jax.Array:
    return jnp.dot(x, self.input_embedding.T)


class Decoder(nn.Module):
  """ids -> logits: lookup, one MLP block, the tied head."""

  flax_embed: bool = False

  @nn.compact
  def __call__(self, ids: jax.Array) -> jax.Array:
    if self.flax_embed:
      embed = nn.Embed(VOCAB, DIM, name="embedder")
      encode, decode = embed, embed.attend
    else:
      embed = GemmaEmbedder(name="embedder")
      encode, decode = embed.encode, embed.decode
    x = encode(ids) / 8.0
    h = nn.Dense(HID, use_bias=False, name="up")(x)
    x = x + nn.Dense(DIM, use_bias=False, name="down")(jnp.tanh(h))
    return decode(x)


def reference64(
  params: dict, ids: np.ndarray, flax_embed: bool, table_float: bool = False
) -> np.ndarray:
  """The served model in float64 (the table's round trip, or the table itself if kept float)."""
  name = "embedding" if flax_embed else "input_embedding"
  table = np.asarray(params["embedder"][name], np.float64)
  if not table_float:
    table = round_trip64(table.astype(np.float32), rows_layout((VOCAB, DIM)))
  up = round_trip64(params["up"]["kernel"], dense_layout((DIM, HID)))
  down = round_trip64(params["down"]["kernel"], dense_layout((HID, DIM)))
  x = table[ids] * (1.0 if flax_embed else np.float64(np.float32(np.sqrt(DIM)))) / 8.0
  x = x + np.tanh(x @ up) @ down
  return x @ table.T


@pytest.fixture(scope="module", params=[False, True], ids=["gemma_embedder", "nn_embed"])
def setup(request):
  flax_embed = request.param
  model = Decoder(flax_embed)
  ids = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (2, 6)), jnp.int32)
  key = jax.random.key(1)
  float_params = jax.jit(model.init)(key, ids)["params"]
  rules = [q8rules.Q8Rule()]
  q8_model = qwix.quantize_model(model, q8rules.Q8Provider(rules))
  return flax_embed, model, q8_model, rules, ids, key, float_params


def test_eval_shape_stores_the_table_untransposed(setup):
  _, _, q8_model, _, ids, key, float_params = setup
  abstract = jax.eval_shape(q8_model.init, key, ids)["params"]
  table = abstract["embedder"]
  table = table.get("embedding", table.get("input_embedding"))
  assert table.shape == (VOCAB, DIM) and table.how.layout.contract == (1,)
  converted = q8rules.quantize_params(float_params, abstract)
  structure = jax.tree.structure(q8_model.init(key, ids)["params"])
  assert jax.tree.structure(converted) == structure


def test_served_against_float64_eager_and_jit(setup):
  flax_embed, _, q8_model, _, ids, key, float_params = setup
  abstract = jax.eval_shape(q8_model.init, key, ids)["params"]
  q8_params = q8rules.quantize_params(float_params, abstract)
  ref = reference64(float_params, np.asarray(ids), flax_embed)
  eager = q8_model.apply({"params": q8_params}, ids)
  jitted = jax.jit(q8_model.apply)({"params": q8_params}, ids)
  assert rel_err(eager, ref) <= 1e-5
  assert rel_err(jitted, eager) <= 1e-6


def test_quantize_params_bit_equal_to_init(setup):
  _, model, q8_model, _, ids, key, _ = setup
  float_params = model.init(key, ids)["params"]
  init_time = q8_model.init(key, ids)["params"]  # the same key: the same float values
  converted = q8rules.quantize_params(float_params, init_time)
  for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(init_time), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_float_params_to_the_q8_model_are_refused_naming_the_param(setup):
  _, _, q8_model, _, ids, _, float_params = setup
  with pytest.raises(ValueError, match=r"^up/kernel: an unquantized param to a quantized model"):
    jax.jit(q8_model.apply)({"params": float_params}, ids)


def test_a_float_table_given_is_looked_up_and_used_float(setup):
  """Q8 kernels with the table kept float (as a GGUF's float token_embd): lookup and head float."""
  flax_embed, _, q8_model, rules, ids, key, float_params = setup
  provider = q8rules.Q8Provider(rules)
  q8_model = qwix.quantize_model(Decoder(flax_embed), provider)
  q8_params = q8rules.quantize_params(
    float_params, jax.eval_shape(q8_model.init, key, ids)["params"]
  )
  q8_params["embedder"] = float_params["embedder"]
  out = jax.jit(q8_model.apply)({"params": q8_params}, ids)
  ops = {(r.module, r.op): r for r in provider.report().ops}
  assert ops[("embedder", "take0")].note == "lookup: the table was given float"
  assert ops[("embedder", "dot_general0")].path == "float"
  assert rel_err(out, reference64(float_params, np.asarray(ids), flax_embed, True)) <= 1e-5


@pytest.mark.slow
def test_qat_apply_first_under_jit_and_grad(setup):
  _, _, q8_model, rules, ids, key, float_params = setup
  qat_model = qwix.quantize_model(Decoder(setup[0]), q8rules.Q8QatProvider(rules))
  served = q8_model.apply(
    {
      "params": q8rules.quantize_params(
        float_params, jax.eval_shape(q8_model.init, key, ids)["params"]
      )
    },
    ids,
  )
  qat = jax.jit(qat_model.apply)({"params": float_params}, ids)  # no init: apply comes first
  assert rel_err(qat, served) <= 1e-5

  def loss(p: dict) -> jax.Array:
    return jnp.mean(qat_model.apply({"params": p}, ids) ** 2)

  grads = jax.jit(jax.grad(loss))(float_params)
  table = grads["embedder"]
  table = table.get("embedding", table.get("input_embedding"))
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert np.abs(np.asarray(table)).sum() > 0  # the lookup and the head both train the table
