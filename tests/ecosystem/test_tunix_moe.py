"""Tunix's Gemma 4 (E2B-shaped with per-layer inputs and shared KV, 31B-shaped, 26B-A4B-shaped
MoE) and Qwen 3 MoE, unmodified, under `Q8Provider([Q8Rule(module_path='.*')])`: every expert
weight is a Q8_0 param (no float copy), routers and Gemma's per-layer model projection stay
float as llama.cpp's quantizer keeps them, every weight left float is in the report with why,
and QAT is the served model.

Run with `pytest -m ecosystem tests/ecosystem` after installing `.[ecosystem]` and
google-tunix (docs/ecosystem.md).
"""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules.providers.q8_weight import Q8Weight
from tests._utils import rel_err
from tests.ecosystem import tunix_checks as tc
from tests.ecosystem import tunix_moe_models as tm

pytestmark = [
  pytest.mark.ecosystem,
  pytest.mark.usefixtures("float32_matmuls", "tunix_flags"),
  pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="google-tunix missing"),
]


@pytest.fixture
def tunix_flags():
  """Each test under the Flax flags Tunix sets on import, the session's own restored after (an
  import of Tunix at collection would change them for every later test of the process)."""
  with tc.tunix_flags():
    yield


MOE = ("gemma4-moe", "qwen3-moe")


def rules(**kw) -> list[q8rules.Q8Rule]:
  return [q8rules.Q8Rule(module_path=".*", **kw)]


def q8_params(model: nnx.Module) -> dict[str, Q8Weight]:
  """path -> every Q8 param of an nnx model."""
  out = {}
  for path, module in nnx.iter_modules(model):
    for name, value in vars(module).items():
      if isinstance(value, Q8Weight):
        out["/".join(map(str, (*path, name)))] = value
  return out


@pytest.fixture(scope="module", params=tm.CASES, ids=lambda c: c.id)
def served(request):
  case = request.param
  args = tm.inputs()
  with tc.tunix_flags():
    float_model = tm.build(case)
    ref = tm.logits(float_model, args)
  provider = q8rules.Q8Provider(rules())
  with warnings.catch_warnings(), tc.tunix_flags():
    warnings.simplefilter("ignore", DeprecationWarning)
    model = qwix.quantize_model(tm.build(case), provider, *args)
    out = tm.logits(model, args)
  return case, args, ref, model, provider, out


def test_every_expert_weight_is_q8_0(served):
  case, _, _, model, provider, _ = served
  q8 = q8_params(model)
  experts = {p: w for p, w in q8.items() if w.how.layout.batch}
  if case.name in MOE:
    names = ("gating_einsum", "linear") if case.name == "gemma4-moe" else ("gate_proj", "up_proj")
    assert len(experts) >= 2 * tm.LAYERS, sorted(q8)
    for path, w in experts.items():
      assert np.dtype(w.array.q.dtype) == np.int8, path
      assert w.array.q.shape[0] == tm.EXPERTS, path
    assert any(n in p for p in experts for n in names)
  # no float weight of two or more axes is left in the model but those the report names
  listed = {p.path for p in provider.report().float_params}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      value = node.get_value()
      if isinstance(value, jax.Array) and value.ndim >= 2 and "array" not in map(str, path):
        name = "/".join(map(str, path))
        assert name in listed, f"{name} {value.shape} stays float with no report line"


def test_routers_and_per_layer_projection_stay_float_with_a_reason(served):
  case, _, _, _, provider, _ = served
  report = provider.report()
  reasons = {p.path: p.reason for p in report.float_params}
  if case.name in MOE:
    routers = [p for p in reasons if "router" in p]
    assert routers and all("router" in reasons[p] for p in routers), reasons
  if case.name == "gemma4-e2b":
    proj = [p for p in reasons if "per_layer_model_projection" in p]
    assert proj and "per_layer_model_proj" in reasons[proj[0]]


def test_served_logits_near_float(served):
  case, _, ref, _, _, out = served
  limit = 3e-2 if case.dtype == "float32" else 6e-2
  assert rel_err(out, ref) <= limit


def test_jit_equals_eager(served):
  case, args, _, model, _, out = served
  jitted = jax.jit(lambda m, *a: tm.logits(m, a))(model, *args)
  assert rel_err(jitted, out) <= (1e-6 if case.dtype == "float32" else 1e-2)


@pytest.mark.parametrize("case", [c for c in tm.CASES if c.dtype == "float32"], ids=lambda c: c.id)
def test_qat_forward_is_the_served_model_and_trains(case):
  args = tm.inputs()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    served = qwix.quantize_model(tm.build(case), q8rules.Q8Provider(rules()), *args)
    qat = qwix.quantize_model(tm.build(case), q8rules.Q8QatProvider(rules()), *args)
    assert np.array_equal(np.asarray(tm.logits(qat, args)), np.asarray(tm.logits(served, args)))

    def loss(m):
      return jnp.mean(tm.logits(m, args) ** 2)

    grads = nnx.grad(loss)(qat)
  flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(grads)}
  experts = [k for k in flat if any(n in k for n in ("gating_einsum", "gate_proj", "linear"))]
  for k in experts:
    g = np.asarray(flat[k], np.float32)
    assert np.all(np.isfinite(g)) and np.abs(g).sum() > 0, k


def dequantized(w: Q8Weight) -> np.ndarray:
  """A Q8 param (a matrix or a stack of experts) back in its float shape, in float64."""
  layout = w.how.layout
  q = np.asarray(w.array.q, np.float64)
  d = np.repeat(np.asarray(w.array.scale, np.float64), 32, axis=layout.blocked_axis)
  order = layout.batch + layout.contract + layout.free
  moved = (q * d)[..., : layout.k, :].reshape([layout.shape[a] for a in order])
  return np.transpose(moved, np.argsort(order))


@pytest.mark.parametrize("name", MOE)
def test_served_model_against_its_own_q8_0_weights(name):
  """The served MoE model against the float model given the same Q8_0 values (dequantised):
  the routers stay float, so the routing is the same, and the two differ only by the products'
  rounding."""
  case = tm.Case(name, "float32")
  args = tm.inputs()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    served = qwix.quantize_model(tm.build(case), q8rules.Q8Provider(rules()), *args)
    out = tm.logits(served, args)
  float_model = tm.build(case)
  modules = dict(nnx.iter_modules(float_model))
  for path, w in q8_params(served).items():
    *where, attr = path.split("/")
    module = modules[tuple(int(p) if p.isdigit() else p for p in where)]
    getattr(module, attr)[...] = jnp.asarray(dequantized(w), jnp.float32)
  assert rel_err(out, tm.logits(float_model, args)) <= 1e-5
