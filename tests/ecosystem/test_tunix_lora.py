"""Tunix's QLoRA recipe on a Q8_0 base: Tunix's Gemma 3 and Qwen 3, as they ship,
adapted by `qwix.apply_lora_to_model` with `q8rules.Q8LoraProvider` (Tunix's module_path, rank
16, alpha 2) and trained by Tunix's own `PeftTrainer` on its `TrainingInput`s with its default
loss, unmodified; the gradients of every adapter, and of a decoder layer's input x, against a
float64 twin of the model on the same Q8_0 values (tests/ecosystem/tunix_lora.py).
Run with `pytest -m ecosystem` (docs/ecosystem.md)."""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from tests._utils import rel_err
from tests.ecosystem import tunix_checks as tc
from tests.ecosystem import tunix_lora as tl
from tests.ecosystem import tunix_models as tm

pytestmark = [
  pytest.mark.ecosystem,
  pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="needs google-tunix"),
]

STEPS = 6

GRAD_TOL = 1e-5
"""The gradients of A, B and x are held within 1e-5 (relative L2) of float64's."""

TRAINED = [
  ("gemma3", "float32", "q8"),
  ("gemma3", "bfloat16", "q8"),
  ("qwen3", "float32", "q8"),
  ("qwen3", "bfloat16", "q8"),
  ("gemma3", "float32", "matched"),
  ("qwen3", "float32", "matched"),
]
"""(model, dtype, base): 'q8' every weight Q8_0, 'matched' only the adapted ones (Tunix's
keyword call as written; `tl.provider`)."""


@pytest.mark.parametrize("name,dtype,base", TRAINED, ids=["-".join(t) for t in TRAINED])
def test_peft_trainer_trains_only_the_adapters_of_a_q8_base(name, dtype, base, rng):
  _, sft_utils = tl.peft()
  with tc.tunix_flags():
    model = tm.build(tl.case(name, dtype), rng)
    matrices = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param) and v.ndim >= 2]
    matched = tl.matched_modules(model, tl.MODULE_PATH[name])
    lora_model, provider = tl.adapt(model, name, base)

  # An adapter on every product Tunix's module_path names, and nowhere else.
  assert len(matched) == tl.ADAPTED_PER_LAYER[name] * tm.LAYERS
  adapters = tl.adapters(lora_model)
  assert {"/".join(map(str, p[:-1])) for p in adapters} == matched
  q8 = tl.q8_weights(lora_model)
  for path, (a, b) in adapters.items():
    layout = q8[path].how.layout
    assert (a.shape, b.shape) == ((layout.k, tl.RANK), (tl.RANK, layout.n))
    assert a.dtype == b.dtype == jnp.float32
  assert len(q8) == (len(matrices) if base == "q8" else len(adapters))
  assert set(adapters) <= set(q8)
  assert sft_utils.is_lora_enabled(lora_model)  # PeftTrainer then trains nnx.LoRAParam only

  base_before = tl.leaf_bytes(nnx.state(lora_model, nnx.Not(nnx.LoRAParam)))
  lora_before = tl.leaf_bytes(nnx.state(lora_model, nnx.LoRAParam))
  with tc.tunix_flags():
    trainer = tl.train(lora_model, tl.training_input(rng), STEPS)

  losses, evals = tl.losses(trainer, "train"), tl.losses(trainer, "eval")
  assert trainer.train_steps == STEPS and len(losses) == STEPS and len(evals) == 2
  assert np.all(np.diff(losses) < 0), losses  # the same batch every step
  assert evals[1] < evals[0]
  assert tl.leaf_bytes(nnx.state(lora_model, nnx.Not(nnx.LoRAParam))) == base_before
  lora_after = tl.leaf_bytes(nnx.state(lora_model, nnx.LoRAParam))
  assert len(lora_after) == 2 * len(adapters)
  assert all(x != y for x, y in zip(lora_before, lora_after, strict=True))
  served = [r for r in provider.report().ops if r.rule == 0]  # the adapters' rule
  assert {r.module for r in served} == matched
  assert all(r.q8_bytes > 0 and r.path not in ("float", "fake_quant") for r in served)


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_model_grads_of_every_adapter_against_float64(name, rng):
  """Tunix's loss on the whole adapted model (tied head or lm_head included), random A and B,
  under `nnx.jit` as PeftTrainer takes it."""
  peft_trainer, _ = tl.peft()
  with tc.tunix_flags():
    model = tm.build(tl.case(name), rng)
    lora_model, _ = tl.adapt(model, name)
  tl.randomize_adapters(lora_model, rng)
  inputs = tl.model_inputs(tl.training_input(rng))

  def loss(m: nnx.Module) -> jax.Array:
    return peft_trainer._default_loss_fn(m, **inputs)  # noqa: SLF001 (PeftTrainer's own loss)

  step = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
  value, grads = step(lora_model)
  got = tl.grads_by_weight(grads)
  with tc.tunix_flags(), jax.enable_x64(True):
    twin = tl.float64_twin(lora_model, tl.build64(name))
    ref_value, ref = jax.value_and_grad(lambda ab: loss(twin.module(ab)))(tl.lora64(lora_model))

  assert len(got) == tl.ADAPTED_PER_LAYER[name] * tm.LAYERS and set(got) == set(ref)
  assert rel_err(value, ref_value) <= GRAD_TOL
  for path, (da, db) in got.items():
    assert rel_err(da, ref[path][0]) <= GRAD_TOL, path
    assert rel_err(db, ref[path][1]) <= GRAD_TOL, path


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_decoder_layer_grads_of_x_and_adapters_against_float64(name, rng):
  """One of Tunix's decoder layers (attention and MLP, every product Q8_0, Tunix's module_path
  adapted) on random activations x: the gradients of x (through the Q8_0 products' transposes
  and the adapters) and of A and B, for a random cotangent."""
  with tc.tunix_flags():
    model = tm.build(tl.case(name), rng)
    _, positions, _, mask = tm.inputs()
    x = jnp.asarray(rng.standard_normal((*positions.shape, tm.DIM)), jnp.float32)
    cotangent = rng.standard_normal(x.shape)
    layer = qwix.apply_lora_to_model(
      tl.DecoderLayerOnX(model.layers[0]), tl.provider(name), x, positions, mask, rngs=nnx.Rngs(0)
    )
  tl.randomize_adapters(layer, rng)

  def loss(m: nnx.Module, x: jax.Array) -> jax.Array:
    out = m(x, positions, mask)
    return jnp.sum(out * jnp.asarray(cotangent, out.dtype))

  grad = nnx.jit(nnx.grad(loss, argnums=(nnx.DiffState(0, nnx.LoRAParam), 1)))
  grads, dx = grad(layer, x)
  got = tl.grads_by_weight(grads)
  with tc.tunix_flags(), jax.enable_x64(True):
    twin = tl.float64_twin(layer, tl.DecoderLayerOnX(tl.build64(name).layers[0]))
    x64 = jnp.asarray(x, jnp.float64)
    ref, ref_dx = jax.grad(lambda ab, x: loss(twin.module(ab), x), argnums=(0, 1))(
      tl.lora64(layer), x64
    )

  assert len(got) == tl.ADAPTED_PER_LAYER[name] and set(got) == set(ref)
  assert rel_err(dx, ref_dx) <= GRAD_TOL
  for path, (da, db) in got.items():
    assert rel_err(da, ref[path][0]) <= GRAD_TOL, path
    assert rel_err(db, ref[path][1]) <= GRAD_TOL, path


def test_a_module_path_matching_no_product_is_refused_naming_it():
  """Tunix's Gemma module_path on Qwen 3 (whose projections are q_proj, ..., not einsums named
  q_einsum): refused while adapting, naming the rule's module_path."""
  with tc.tunix_flags():
    model = tm.build(tl.case("qwen3"), np.random.default_rng(0))
    provider = q8rules.Q8LoraProvider(module_path=".*q_einsum|.*kv_einsum", rank=16, alpha=2.0)
    with pytest.raises(ValueError, match=re.escape("module_path='.*q_einsum|.*kv_einsum'")):
      qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(0), **model.get_model_input())
