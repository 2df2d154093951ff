"""Tunix's sharded QLoRA training on a Q8_0 base: Tunix's Gemma 3 and Qwen 3 on a
2 x 2 (fsdp x tp) CPU mesh, split by their own default `ShardingConfig` (every adapted weight
along its contracted axes and its output axes), adapted by `q8rules.Q8LoraProvider` with
Tunix's module_path (tests/ecosystem/tunix_lora.py) and trained by Tunix's `PeftTrainer` under
`with mesh:`, as Tunix's QLoRA demo and its CLI run it. Two of Tunix's ways onto the mesh:

  * 'placed': the float model placed by its annotations first (`nnx.get_named_sharding`,
    `jax.device_put`: what `AutoModel.from_pretrained(..., mesh)` gives), adapted there, then
    the QLoRA demo's step: `with mesh:`, `jax.lax.with_sharding_constraint(state,
    nnx.get_partition_spec(state))`;
  * 'reshard': adapted on one device, then `tunix.rl.reshard.reshard_model_to_mesh` (the CLI's
    step after `apply_lora_to_model`), which places every leaf by its annotation alone.

Held: each adapter follows its base as annotated and as placed (A (K, rank) split along K as
the base's contracted axes are, B (rank, N) along N as its output axes are, rank whole), before
and after training; the losses equal those of the same model trained on one device; the base's
bytes are the unsharded model's and training keeps them; the gradients on the mesh against the
float64 twin. Needs 4 devices: tests/conftest.py gives the CPU backend 8.
"""

from __future__ import annotations

import importlib.util
import zlib
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules.layout import WeightLayout
from q8rules.sharding.specs import spec_entries
from tests._utils import rel_err
from tests.ecosystem import tunix_checks as tc
from tests.ecosystem import tunix_lora as tl
from tests.ecosystem import tunix_models as tm

pytestmark = [
  pytest.mark.ecosystem,
  pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="needs google-tunix"),
  # Tunix's trainer reads the mesh `with mesh:` sets (`pxla.thread_resources`), which
  # `jax.set_mesh` does not; JAX 0.10 calls that context manager deprecated.
  pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning"),
]

AXES = ("fsdp", "tp")
STEPS = 6
LOSS_TOL = 1e-5
"""Each step's train loss, and each eval loss, on the mesh within 1e-5 (relative) of the
unsharded run's."""

GRAD_TOL = 1e-5
"""The gradients of A and B are held within 1e-5 (relative L2) of float64's."""

FLOWS = ("placed", "reshard")
CASES = [(name, flow) for name in ("gemma3", "qwen3") for flow in FLOWS]

Path = tuple[str | int, ...]
Entry = Any
"""A PartitionSpec entry: None, a mesh axis name or a tuple of them."""


def _mesh() -> jax.sharding.Mesh:
  if jax.device_count() < 4:
    pytest.skip(f"needs 4 devices, found {jax.device_count()} (tests/conftest.py sets 8 on CPU)")
  return jax.make_mesh((2, 2), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])


def _seed(name: str) -> np.random.Generator:
  """The same fresh data for a model's sharded and unsharded runs."""
  return np.random.default_rng(zlib.crc32(f"tunix-lora-mesh-{name}".encode()))


def _annotations(model: nnx.Module) -> dict[Path, tuple[Entry, ...]]:
  """param path -> its sharding annotation as Tunix wrote it (`nnx.get_partition_spec`)."""
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  return {tuple(p): tuple(tl.value(v)) for p, v in specs.flat_state()}


def _split(annotation: tuple[Entry, ...], axes: tuple[int, ...]) -> Entry:
  """The mesh axis the annotation splits among the weight `axes` (None when it splits none)."""
  named = [annotation[i] for i in axes if annotation[i] is not None]
  assert len(named) <= 1, (annotation, axes)
  return named[0] if named else None


def _expected(annotation: tuple[Entry, ...], layout: WeightLayout) -> tuple[Entry, Entry]:
  """(K's entry, N's entry) of a base from the float weight's annotation: its contracted axes
  split K, its free axes split N."""
  return _split(annotation, layout.contract), _split(annotation, layout.free)


def _placed(x: jax.Array, mesh: jax.sharding.Mesh) -> tuple[Entry, ...]:
  """The spec entries `x` is placed by on `mesh` (an error when it is not on that mesh)."""
  assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, x.sharding
  return spec_entries(x.sharding.spec, x.ndim, "placed")


def _shard_shape(shape: tuple[int, ...], entries: tuple[Entry, ...], mesh) -> tuple[int, ...]:
  return tuple(
    s // (1 if e is None else mesh.shape[e]) for s, e in zip(shape, entries, strict=True)
  )


def _lora_model(name: str, flow: str | None, mesh: jax.sharding.Mesh | None):
  """Tunix's model `name` adapted by `Q8LoraProvider`, on `mesh` by `flow` (None: one device).
  Returns (model, float annotations, provider)."""
  with tc.tunix_flags():
    model = tm.build(tl.case(name), _seed(name))
    annotations = _annotations(model)
    if flow == "placed":
      state = nnx.state(model)
      nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    lora_model, provider = tl.adapt(model, name)
    if flow == "placed":
      with mesh:
        state = nnx.state(lora_model)
        pspecs = nnx.get_partition_spec(state)
        nnx.update(lora_model, jax.lax.with_sharding_constraint(state, pspecs))
    elif flow == "reshard":
      from tunix.rl import reshard

      lora_model = reshard.reshard_model_to_mesh(lora_model, mesh)
  return lora_model, annotations, provider


_UNSHARDED: dict[str, tuple[np.ndarray, np.ndarray, list[bytes]]] = {}


def _unsharded(name: str) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
  """(train losses, eval losses, base bytes) of model `name` trained on one device."""
  if name not in _UNSHARDED:
    model, _, _ = _lora_model(name, None, None)
    base = tl.leaf_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    with tc.tunix_flags():
      trainer = tl.train(model, tl.training_input(_seed(name)), STEPS)
    _UNSHARDED[name] = (tl.losses(trainer, "train"), tl.losses(trainer, "eval"), base)
  return _UNSHARDED[name]


def _check_adapters_follow_their_base(
  model: nnx.Module, annotations: dict[Path, tuple[Entry, ...]], mesh: jax.sharding.Mesh
) -> tuple[dict[Path, tuple[Entry, Entry]], dict[str, set[Entry]]]:
  """Each adapter annotated and placed as its base's split says (from Tunix's annotation of
  the float weight), its base's Q8 values placed by that split too.

  Returns:
    adapter path -> its (2) spec entries; and the mesh axes that split K and N over the
    adapted bases ({'k': ..., 'n': ...}), so a caller can see which splits were there.
  """
  specs = nnx.get_partition_spec(nnx.state(model, nnx.LoRAParam))
  annotated = {tuple(p): tuple(tl.value(v)) for p, v in specs.flat_state()}
  q8 = tl.q8_weights(model)
  want: dict[Path, tuple[Entry, Entry]] = {}
  seen: dict[str, set[Entry]] = {"k": set(), "n": set()}
  for path, (a, b) in tl.adapters(model).items():
    k, n = _expected(annotations[path], q8[path].how.layout)
    seen["k"].add(k)
    seen["n"].add(n)
    assert _placed(q8[path].array.q[...], mesh) == (k, n), path  # (K_padded, N)
    for which, adapter, entries in (("a", a, (k, None)), ("b", b, (None, n))):
      where = (*path[:-1], path[-1] + f"_lora_{which}")
      assert spec_entries(P(*annotated[where]), 2, "annotation") == entries, where
      value = adapter[...]
      assert _placed(value, mesh) == entries, where
      assert value.addressable_shards[0].data.shape == _shard_shape(value.shape, entries, mesh)
      want[where] = entries
  return want, seen


@pytest.mark.parametrize("name,flow", CASES, ids=["-".join(c) for c in CASES])
def test_peft_trainer_on_a_mesh_trains_adapters_split_as_their_base(name, flow):
  mesh = _mesh()
  model, annotations, provider = _lora_model(name, flow, mesh)
  adapters = tl.adapters(model)
  assert len(adapters) == tl.ADAPTED_PER_LAYER[name] * tm.LAYERS

  want, seen = _check_adapters_follow_their_base(model, annotations, mesh)
  # Tunix's default ShardingConfig splits every adapted base along K and along N (q, kv, gate,
  # up: K by fsdp, N by tp; down and Qwen's o: K by tp, N by fsdp), so no adapter is whole.
  assert seen == {"k": {"fsdp", "tp"}, "n": {"fsdp", "tp"}}, seen

  base_before = tl.leaf_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
  lora_before = tl.leaf_bytes(nnx.state(model, nnx.LoRAParam))
  with tc.tunix_flags(), mesh:
    trainer = tl.train(model, tl.training_input(_seed(name)), STEPS)
  losses, evals = tl.losses(trainer, "train"), tl.losses(trainer, "eval")
  ref_losses, ref_evals, ref_base = _unsharded(name)

  assert trainer.train_steps == STEPS and losses.shape == (STEPS,) and evals.shape == (2,)
  assert np.all(np.abs(losses - ref_losses) <= LOSS_TOL * np.abs(ref_losses)), (losses, ref_losses)
  assert np.all(np.abs(evals - ref_evals) <= LOSS_TOL * np.abs(ref_evals)), (evals, ref_evals)
  assert evals[1] < evals[0]
  assert base_before == ref_base  # the Q8_0 base: the same bytes as the unsharded model's
  assert tl.leaf_bytes(nnx.state(model, nnx.Not(nnx.LoRAParam))) == base_before
  lora_after = tl.leaf_bytes(nnx.state(model, nnx.LoRAParam))
  assert all(x != y for x, y in zip(lora_before, lora_after, strict=True))
  assert _check_adapters_follow_their_base(model, annotations, mesh)[0] == want  # trained
  moments = 0  # Adam's mu and nu of each adapter, laid out as the adapter
  for path, v in nnx.state(trainer.optimizer, nnx.optimizer.OptState).flat_state():
    for where, entries in want.items():
      if tuple(path)[-len(where) :] == where:
        assert _placed(tl.value(v), mesh) == entries, path
        moments += 1
  assert moments == 2 * len(want)
  served = [r for r in provider.report().ops if r.rule == 0]
  assert len({r.module for r in served}) == len(adapters)
  assert all(r.q8_bytes > 0 and r.path not in ("float", "fake_quant") for r in served)


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_model_grads_on_a_mesh_against_float64(name, rng):
  """Tunix's loss on the whole adapted model on the mesh ('placed'), random A and B placed as
  the adapters, the batch split as Tunix's trainer splits it (`shard_input`, rows along fsdp),
  under `nnx.jit(nnx.value_and_grad)`: each gradient laid out as its adapter, and within 1e-5 of
  the float64 twin's."""
  peft_trainer, _ = tl.peft()
  from tunix.sft import sharding_utils

  mesh = _mesh()
  model, _, _ = _lora_model(name, "placed", mesh)
  shardings = {p: (a[...].sharding, b[...].sharding) for p, (a, b) in tl.adapters(model).items()}
  tl.randomize_adapters(model, rng)
  for path, (a, b) in tl.adapters(model).items():
    a.set_value(jax.device_put(a[...], shardings[path][0]))
    b.set_value(jax.device_put(b[...], shardings[path][1]))
  batch = tl.training_input(rng)

  def loss(m: nnx.Module, inputs: dict[str, jax.Array]) -> jax.Array:
    return peft_trainer._default_loss_fn(m, **inputs)  # noqa: SLF001 (PeftTrainer's own loss)

  step = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
  with tc.tunix_flags(), mesh:
    inputs = tl.model_inputs(sharding_utils.shard_input(batch, ("fsdp",)))
    assert _placed(inputs["input_tokens"], mesh) == ("fsdp", None)
    value, grads = step(model, inputs)
  got = tl.grads_by_weight(grads)
  with tc.tunix_flags(), jax.enable_x64(True):
    twin = tl.float64_twin(model, tl.build64(name))
    ref_inputs = tl.model_inputs(batch)
    ref_value, ref = jax.value_and_grad(lambda ab: loss(twin.module(ab), ref_inputs))(
      tl.lora64(model)
    )

  assert len(got) == tl.ADAPTED_PER_LAYER[name] * tm.LAYERS and set(got) == set(ref)
  assert rel_err(value, ref_value) <= GRAD_TOL
  for path, (da, db) in got.items():
    assert da.sharding.is_equivalent_to(shardings[path][0], 2), path
    assert db.sharding.is_equivalent_to(shardings[path][1], 2), path
    assert rel_err(da, ref[path][0]) <= GRAD_TOL, path
    assert rel_err(db, ref[path][1]) <= GRAD_TOL, path


def test_a_k_split_cutting_a_block_is_refused_naming_the_param():
  """On a 4 x 1 mesh fsdp splits the 64 rows of K into 16-row pieces, inside a 32-row block:
  the model placed there ('placed') is refused while adapting, naming the first such param."""
  if jax.device_count() < 4:
    pytest.skip(f"needs 4 devices, found {jax.device_count()} (tests/conftest.py sets 8 on CPU)")
  mesh = jax.make_mesh((4, 1), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=r"^embedder/input_embedding: cannot split K=64 rows"):
    _lora_model("gemma3", "placed", mesh)
