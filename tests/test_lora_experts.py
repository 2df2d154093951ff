"""One LoRA adapter per expert (`Q8LoraRule` on a stack of experts (E, K, N): A (E, K, rank),
B (E, rank, N), as PEFT and Unsloth give MoE experts) on a Q8_0 base, through
`jax.lax.ragged_dot`, `w[i]` slices in a loop of einsums and an einsum batched over the expert
axis: the gradients of A, B and x against a float64 twin of the model whose every expert weight
is its Q8_0 values plus its own expert's A @ B * alpha / rank."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules.lora.merge import merged_weight
from q8rules.providers.q8_weight import Q8Weight
from q8rules.sharding.adapters import LORA_A, LORA_B
from tests._utils import rel_err
from tests.test_experts import GROUPS, D, DenseExperts, E, LoopExperts, RaggedExperts, experts_f64

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RANK, ALPHA = 4, 2.0
FORMS = {
  "ragged_dot": (RaggedExperts, (int(GROUPS.sum()), D)),
  "w[i]": (LoopExperts, (3, D)),
  "batched einsum": (DenseExperts, (2, 3, E, D)),
}


def _args(form: str, x: jax.Array) -> tuple[jax.Array, ...]:
  return (x, jnp.asarray(GROUPS)) if form == "ragged_dot" else (x,)


def _adapted(form: str, rng: np.random.Generator) -> tuple[nnx.Module, jax.Array]:
  """The form's model with an adapter on every expert stack (random A and B), and its x."""
  model_type, x_shape = FORMS[form]
  x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
  provider = q8rules.Q8LoraProvider([q8rules.Q8LoraRule(module_path=".*", rank=RANK, alpha=ALPHA)])
  model = qwix.apply_lora_to_model(
    model_type(np.random.default_rng(1)), provider, *_args(form, x), rngs=nnx.Rngs(0)
  )
  for name, param in vars(model).items():
    if isinstance(param, nnx.LoRAParam):
      rows = param.shape[-2]
      scale = 1 / np.sqrt(rows) if name.endswith(LORA_A) else 4 / np.sqrt(RANK)
      param.set_value(jnp.asarray(scale * rng.standard_normal(param.shape), jnp.float32))
  return model, x


def _twin_loss(model: nnx.Module, form: str, cotangent: np.ndarray):
  """loss64(adapters, x): sum(cotangent * out) of the float64 twin (call under x64)."""
  model_type, _ = FORMS[form]
  twin = model_type(np.random.default_rng(1), dtype=jnp.float64)
  stacks = {n: w for n, w in vars(model).items() if isinstance(w, Q8Weight)}
  base = {n: jnp.asarray(experts_f64(w)) for n, w in stacks.items()}
  graphdef, state = nnx.split(twin)

  def loss(adapters: dict[str, tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    m = nnx.merge(graphdef, jax.tree.map(lambda v: v, state))
    for name, w in stacks.items():
      a, b = adapters[name]
      delta = jnp.einsum("ekr,ern->ekn", a, b) * (ALPHA / RANK)  # (E, K, N)
      getattr(m, name).set_value(base[name] + w.how.layout.from_matrix(delta))
    out = m(*_args(form, x))
    return jnp.sum(jnp.asarray(cotangent) * out)

  return loss


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.slow
def test_expert_adapters_gradients_against_float64(form):
  rng = np.random.default_rng(20)
  model, x = _adapted(form, rng)
  for name, w in vars(model).items():
    if isinstance(w, Q8Weight):
      a, b = getattr(model, name + LORA_A), getattr(model, name + LORA_B)
      layout = w.how.layout
      assert a.shape == (E, layout.k, RANK) and b.shape == (E, RANK, layout.n), name
  out = model(*_args(form, x))
  cotangent = rng.standard_normal(out.shape)

  def loss(m: nnx.Module, x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.asarray(cotangent, jnp.float32) * m(*_args(form, x)))

  grads, dx = nnx.grad(loss, argnums=(nnx.DiffState(0, nnx.LoRAParam), 1))(model, x)
  stacks = [n for n, w in vars(model).items() if isinstance(w, Q8Weight)]
  with jax.enable_x64(True):
    adapters = {
      n: tuple(jnp.asarray(getattr(model, n + s)[...], jnp.float64) for s in (LORA_A, LORA_B))
      for n in stacks
    }
    loss64 = _twin_loss(model, form, cotangent)
    ref, ref_dx = jax.grad(loss64, argnums=(0, 1))(adapters, jnp.asarray(x, jnp.float64))
  assert rel_err(dx, ref_dx) <= 1e-5
  for n in stacks:
    assert rel_err(getattr(grads, n + LORA_A)[...], ref[n][0]) <= 1e-5, n
    assert rel_err(getattr(grads, n + LORA_B)[...], ref[n][1]) <= 1e-5, n


@pytest.mark.slow
def test_expert_adapters_split_join_and_merge():
  """`split_lora` takes the per-expert adapters out ((E, K, rank), (E, rank, N)), `join_lora`
  puts them back (the same outputs), and `merge_lora` folds each expert's adapter into its own
  Q8_0 matrix: each expert of the merged stack is the Q8_0 of its own matrix plus its own
  delta, summed in float64, as a 2-D weight's merge is."""
  rng = np.random.default_rng(21)
  model, x = _adapted("ragged_dot", rng)
  rules = [q8rules.Q8LoraRule(module_path=".*", rank=RANK, alpha=ALPHA)]
  args = _args("ragged_dot", x)
  want = model(*args)
  _, adapters = q8rules.split_lora(model, rules)
  assert {n: (a.a.shape, a.b.shape) for n, a in adapters.items()} == {
    "gating": ((E, D, RANK), (E, RANK, 2 * 32)),
    "linear": ((E, 32, RANK), (E, RANK, D)),
  }
  for name in adapters:
    for suffix in (LORA_A, LORA_B):
      getattr(model, name + suffix).set_value(jnp.zeros(getattr(model, name + suffix).shape))
  nnx.update(model, q8rules.join_lora(model, adapters, rules))
  assert np.array_equal(np.asarray(model(*args)), np.asarray(want))

  merged = q8rules.merge_lora(model, rules)
  for name, adapter in adapters.items():
    stack = getattr(model, name)[...].array
    for e in range(E):
      one = dataclasses.replace(stack, q=stack.q[e], scale=stack.scale[e], axis=0)
      matrix = merged_weight(one, dataclasses.replace(adapter, a=adapter.a[e], b=adapter.b[e]))
      want_q8 = q8rules.quantize(matrix, axis=0)
      assert np.array_equal(merged[name]["array"]["q"][e], want_q8.q), (name, e)
      assert np.array_equal(merged[name]["array"]["scale"][e], want_q8.scale), (name, e)
