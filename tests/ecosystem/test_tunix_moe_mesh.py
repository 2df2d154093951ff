"""Tunix's MoE models on a 2 x 2 (fsdp x tp) CPU mesh with their experts sharded, as Tunix's own
`ShardingConfig` annotates them (each stack's expert axis along fsdp, a matrix axis along tp):
served as Q8_0 in float32 and bfloat16, every expert stack's int8 values and scales split by its
expert axis (expert parallel), the outputs those of the unsharded model; and LoRA adapters on the
experts (one per expert) trained by Tunix's `PeftTrainer` under `with mesh:`, each placed as its
base's values (A (E, K, rank) by the experts' and K's entries, B (E, rank, N) by the experts' and
N's), the losses those of the same training on one device. Needs 4 devices: tests/conftest.py
gives the CPU backend 8."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
import qwix
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import q8rules
from q8rules.sharding.specs import spec_entries
from tests._utils import rel_err
from tests.ecosystem import tunix_checks as tc
from tests.ecosystem import tunix_lora as tl
from tests.ecosystem import tunix_moe_models as tm
from tests.ecosystem.test_tunix_moe_lora import adapt, expert_adapters

pytestmark = [
  pytest.mark.ecosystem,
  pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="needs google-tunix"),
  # Tunix's trainer reads the mesh `with mesh:` sets, which `jax.set_mesh` does not; JAX 0.10
  # calls that context manager deprecated.
  pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning"),
]

AXES = ("fsdp", "tp")
MOE = ("gemma4-moe", "qwen3-moe")
STEPS = 4
LOSS_TOL = 1e-5
TOL = {"float32": 1e-6, "bfloat16": 1e-2}
"""The sharded model's logits against the unsharded model's (relative L2): bfloat16 products
sum their shards' partial results in another order."""


def _mesh() -> jax.sharding.Mesh:
  if jax.device_count() < 4:
    pytest.skip(f"needs 4 devices, found {jax.device_count()} (tests/conftest.py sets 8 on CPU)")
  return jax.make_mesh((2, 2), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])


def _entries(x: jax.Array, mesh: jax.sharding.Mesh) -> tuple:
  assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, x.sharding
  return spec_entries(x.sharding.spec, x.ndim, "placed")


SERVED = [(n, d) for n in MOE for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("name,dtype", SERVED, ids=["-".join(c) for c in SERVED])
def test_served_with_experts_sharded_equals_unsharded(name, dtype):
  mesh = _mesh()
  with tc.tunix_flags():
    model = tm.build(tm.Case(name, dtype), 7)
    args = tm.inputs()
    with jax.set_mesh(mesh):  # quantized under the mesh: K splits are checked here
      q8 = qwix.quantize_model(model, q8rules.Q8Provider([q8rules.Q8Rule()]), *args)
    unsharded = tc.jit_forward(q8, args)
    state = nnx.state(q8)
    with jax.set_mesh(mesh):
      nnx.update(q8, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
      sharded = tc.jit_forward(q8, args)
  assert rel_err(sharded, unsharded) <= TOL[dtype]
  stacks = [w for _, w in nnx.iter_graph(q8) if hasattr(w, "how") and w.how.layout.batch]
  assert len(stacks) >= 2 * tm.LAYERS
  for w in stacks:
    q = w.array.q[...]
    assert _entries(q, mesh)[0] == "fsdp"  # the expert axis: expert parallel
    assert q.addressable_shards[0].data.shape[0] == tm.EXPERTS // 2


def _trained(name: str, mesh: jax.sharding.Mesh | None):
  """(model, losses, evals) of model `name` adapted (`adapt`) and trained `STEPS` steps by
  PeftTrainer: on `mesh` (Tunix's CLI's way: adapted on one device, then every leaf placed by
  its annotation, `tunix.rl.reshard.reshard_model_to_mesh`) or on one device. Gemma 4's single
  global KV head cannot be placed along tp before quantization, so the float model is not
  placed first."""
  rng = np.random.default_rng(31)
  if mesh is None:
    model, _ = adapt(name, "float32")
    with tc.tunix_flags():
      trainer = tl.train(model, tl.training_input(rng), STEPS)
    return model, tl.losses(trainer, "train"), tl.losses(trainer, "eval")
  from tunix.rl import reshard

  model, _ = adapt(name, "float32")
  with tc.tunix_flags():
    model = reshard.reshard_model_to_mesh(model, mesh)
  with tc.tunix_flags(), mesh:
    trainer = tl.train(model, tl.training_input(rng), STEPS)
  return model, tl.losses(trainer, "train"), tl.losses(trainer, "eval")


@pytest.mark.parametrize("name", MOE)
def test_peft_trainer_on_a_mesh_trains_expert_adapters_split_as_their_base(name):
  mesh = _mesh()
  model, losses, evals = _trained(name, mesh)
  q8 = tl.q8_weights(model)
  experts = expert_adapters(model, name)
  assert experts
  for path, (a, b) in experts.items():
    e, k, n = _entries(q8[path].array.q[...], mesh)
    assert e == "fsdp", path
    assert _entries(a[...], mesh) == (e, k, None), path
    assert _entries(b[...], mesh) == (e, None, n), path
  _, ref_losses, ref_evals = _trained(name, None)
  assert np.all(np.abs(losses - ref_losses) <= LOSS_TOL * np.abs(ref_losses)), (losses, ref_losses)
  assert np.all(np.abs(evals - ref_evals) <= LOSS_TOL * np.abs(ref_evals)), (evals, ref_evals)
  assert evals[1] < evals[0]
