"""Tunix's MoE models (Gemma 4 26B-A4B-shaped, experts through `jax.lax.ragged_dot`; Qwen 3
30B-A3B-shaped, experts as `w[i]` slices) with LoRA on a Q8_0 base: one adapter per expert (A
(E, K, rank), B (E, rank, N)) and on the attention products, made by `qwix.apply_lora_to_model`
with `q8rules.Q8LoraProvider` and trained by Tunix's own `PeftTrainer` with its default loss,
unmodified; the gradients of every adapter against a float64 twin of the model on the same Q8_0
values (tests/ecosystem/tunix_lora.py). Run with `pytest -m ecosystem` (docs/ecosystem.md)."""

from __future__ import annotations

import importlib.util

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
from tests.ecosystem import tunix_moe_models as tm

pytestmark = [
  pytest.mark.ecosystem,
  pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="needs google-tunix"),
]

RANK, ALPHA, STEPS = tl.RANK, tl.ALPHA, 4
"""Tunix's QLoRA rank and alpha (the float64 twin scales every delta by them)."""
GRAD_TOL = 1e-5

MODULE_PATH = {
  "gemma4-moe": ".*q_einsum|.*kv_einsum|.*k_einsum|.*moe",
  "qwen3-moe": ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*mlp",
}
"""Tunix's LoRA recipes' attention projections, and the MoE block (its expert stacks: Gemma 4's
`gating_einsum` and `linear`, Qwen 3's `gate_proj`, `up_proj`, `down_proj`; the router stays
float and takes no adapter)."""

EXPERT_STACKS = {
  "gemma4-moe": ("gating_einsum", "linear"),
  "qwen3-moe": ("gate_proj", "up_proj", "down_proj"),
}


def adapt(name: str, dtype: str, seed: int = 0) -> tuple[nnx.Module, q8rules.Q8LoraProvider]:
  """The MoE model `name` with adapters where `MODULE_PATH` says, every other weight Q8_0."""
  rules = [q8rules.Q8LoraRule(module_path=MODULE_PATH[name], rank=RANK, alpha=ALPHA)]
  provider = q8rules.Q8LoraProvider([*rules, q8rules.Q8Rule()])
  with tc.tunix_flags():
    model = tm.build(tm.Case(name, dtype), seed)
    adapted = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(0), **model.get_model_input())
  return adapted, provider


def expert_adapters(model: nnx.Module, name: str) -> dict[tuple, tuple]:
  """The adapters of the model's expert stacks, by weight path."""
  return {p: ab for p, ab in tl.adapters(model).items() if str(p[-1]) in EXPERT_STACKS[name]}


CASES = [(n, d) for n in MODULE_PATH for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("name,dtype", CASES, ids=["-".join(c) for c in CASES])
def test_peft_trainer_trains_expert_adapters_of_a_q8_moe(name, dtype, rng):
  _, sft_utils = tl.peft()
  model, provider = adapt(name, dtype)
  experts = expert_adapters(model, name)
  assert len(experts) == len(EXPERT_STACKS[name]) * tm.LAYERS
  q8 = tl.q8_weights(model)
  for path, (a, b) in experts.items():
    layout = q8[path].how.layout
    assert layout.batch == (0,) and np.dtype(q8[path].array.q[...].dtype) == np.int8
    assert (a.shape, b.shape) == ((tm.EXPERTS, layout.k, RANK), (tm.EXPERTS, RANK, layout.n))
  assert sft_utils.is_lora_enabled(model)

  base_before = tl.leaf_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
  lora_before = tl.leaf_bytes(nnx.state(model, nnx.LoRAParam))
  with tc.tunix_flags():
    trainer = tl.train(model, tl.training_input(rng), STEPS)
  losses, evals = tl.losses(trainer, "train"), tl.losses(trainer, "eval")
  assert trainer.train_steps == STEPS and len(losses) == STEPS
  assert np.all(np.diff(losses) < 0), losses  # the same batch every step
  assert evals[1] < evals[0]
  assert tl.leaf_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam))) == base_before
  lora_after = tl.leaf_bytes(nnx.state(model, nnx.LoRAParam))
  assert all(x != y for x, y in zip(lora_before, lora_after, strict=True))
  served = [r for r in provider.report().ops if r.rule == 0 and r.path != "float"]
  assert served and all(r.q8_bytes > 0 and r.path != "fake_quant" for r in served)


@pytest.mark.parametrize("name", list(MODULE_PATH))
def test_model_grads_of_expert_adapters_against_float64(name, rng):
  """Tunix's loss on the whole adapted MoE model, random A and B, under `nnx.jit` as PeftTrainer
  takes it: every adapter's gradient (expert stacks' and attention's) within 1e-5 of the float64
  twin's, whose expert weights are their Q8_0 values plus each expert's own delta."""
  peft_trainer, _ = tl.peft()
  model, _ = adapt(name, "float32")
  tl.randomize_adapters(model, rng)
  inputs = tl.model_inputs(tl.training_input(rng))

  def loss(m: nnx.Module) -> jax.Array:
    return peft_trainer._default_loss_fn(m, **inputs)  # noqa: SLF001 (PeftTrainer's own loss)

  step = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
  value, grads = step(model)
  got = tl.grads_by_weight(grads)
  with tc.tunix_flags(), jax.enable_x64(True):
    twin = tl.float64_twin(model, tm.build(tm.Case(name, "float64")))
    ref_value, ref = jax.value_and_grad(lambda ab: loss(twin.module(ab)))(tl.lora64(model))

  assert set(got) == set(ref) and set(expert_adapters(model, name)) <= set(got)
  assert rel_err(value, ref_value) <= GRAD_TOL
  for path, (da, db) in got.items():
    assert rel_err(da, ref[path][0]) <= GRAD_TOL, path
    assert rel_err(db, ref[path][1]) <= GRAD_TOL, path
    assert np.abs(np.asarray(da)).sum() > 0 and np.abs(np.asarray(db)).sum() > 0, path


def test_expert_adapters_scale_like_their_rule():
  """The adapted model with zero B is the Q8_0 model bit for bit (PEFT's start), and the expert
  adapters change it once B is set."""
  model, _ = adapt("qwen3-moe", "float32")
  args = tm.inputs()
  with tc.tunix_flags():
    served = qwix.quantize_model(
      tm.build(tm.Case("qwen3-moe", "float32")), q8rules.Q8Provider([q8rules.Q8Rule()]), *args
    )
  assert np.array_equal(np.asarray(tm.logits(model, args)), np.asarray(tm.logits(served, args)))
  for _, b in expert_adapters(model, "qwen3-moe").values():
    b.set_value(jnp.ones(b.shape, jnp.float32))
  assert rel_err(tm.logits(model, args), tm.logits(served, args)) > 1e-3
