"""Q8QatProvider as users meet it: the rules it refuses or ignores, non-finite weights, and
the digits benchmark (benchmarks/qat_digits.py) run quick. The numerics: tests/test_qat.py."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules import kernels
from q8rules.layout import WeightLayout
from q8rules.providers.qat import fake_quant_ste
from tests._qat_models import (
  LINEN_RULES,
  NNX_RULES,
  LinenNet,
  ScanNet,
  data,
  linen_params,
  mse,
  nnx_model,
  np_fq,
)
from tests._utils import matrix

pytestmark = pytest.mark.usefixtures(
  "float32_matmuls"
)  # float references: float32 on every backend


# ---- rules and non-finite weights ----------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, words",
  [
    ({"act_qtype": "int8"}, "act_qtype"),
    ({"tile_size": 64}, "tile_size"),
    ({"weight_calibration_method": "rms,3"}, "weight_calibration_method"),
    ({"scale_dtype": jnp.bfloat16}, "scale_dtype"),
  ],
)
def test_rule_qat_cannot_honour_raises(kwargs, words):
  """Refused when the rule is made, the reason first (before the rule's long repr)."""
  with pytest.raises(ValueError, match=f"^Q8Rule cannot honour {words}"):
    q8rules.Q8QatProvider([q8rules.Q8Rule(**kwargs)])


def test_qat_provider_wants_a_q8rule():
  with pytest.raises(TypeError, match="Q8QatProvider takes q8rules.Q8Rule"):
    q8rules.Q8QatProvider([qwix.QtRule(weight_qtype="int8")])


@pytest.mark.slow
def test_serving_options_choose_the_forward_kernel(rng):
  """implementation/interpret pick the kernel QAT's forward runs, as they pick the served
  model's; a shape the named implementation cannot run (the fold at 12 rows > its 8) runs on
  the default one, said in the report. The values agree within float32 summation order."""
  x, _ = data(rng)
  model = LinenNet()
  params = linen_params(model, x, rng)
  outs, reports = [], []
  for rule in (
    q8rules.Q8Rule(module_path="up|heads|out"),
    q8rules.Q8Rule(module_path="up|heads|out", implementation="fold", interpret=True),
  ):
    provider = q8rules.Q8QatProvider([rule])
    outs.append(
      np.asarray(jax.jit(qwix.quantize_model(model, provider).apply)({"params": params}, x))
    )
    reports.append(provider.report())
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
  default = kernels.resolve_product(12, 64, 96, jnp.float32)
  assert f"forward: the served product ({default})" in reports[0].ops[0].note
  assert "implementation='fold' cannot run this shape" in reports[1].ops[0].note
  assert "implementation" not in reports[0].ops[0].note


@pytest.mark.parametrize("bad", matrix([np.nan, np.inf], np.nan))
def test_non_finite_weight(rng, bad):
  x, y = data(rng)
  model = LinenNet()
  params = linen_params(model, x, rng)
  params["heads"]["kernel"] = params["heads"]["kernel"].at[7, 1, 2].set(bad)
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider(LINEN_RULES))
  # Training: the loss is nan, as float training with that weight would make it; no error,
  # no silent repair.
  loss = jax.jit(lambda p: mse(qat.apply({"params": p}, x), y))(params)
  assert np.isnan(float(loss))
  # The nan stays in its 32-block (rows 0..31 of column (1, 2)); the other blocks are as usual.
  w = params["heads"]["kernel"]
  layout = WeightLayout((96, 4, 8), (0,), (1, 2))
  fq = np.asarray(jax.jit(lambda a: fake_quant_ste(a, layout, "float32"))(w))
  block = np.zeros(w.shape, bool)
  block[:32, 1, 2] = True
  assert np.isnan(fq[block]).all()
  w_ok = np.asarray(w).copy()
  w_ok[7, 1, 2] = 0.0
  np.testing.assert_array_equal(fq[~block], np_fq(w_ok, 1)[~block])
  # Conversion refuses, naming the param.
  serving = qwix.quantize_model(model, q8rules.Q8Provider(LINEN_RULES))
  abstract = jax.eval_shape(serving.init, jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="heads/kernel.*non-finite"):
    q8rules.quantize_params(params, abstract)


@pytest.mark.slow
def test_non_finite_weight_nnx_and_stacked(rng):
  x, _ = data(rng)
  net = nnx_model(rng)
  serving = qwix.quantize_model(net, q8rules.Q8Provider(NNX_RULES), x)
  pure = nnx.to_pure_dict(nnx.state(net, nnx.Param))
  pure["w"] = pure["w"].at[3, 4].set(np.nan)
  with pytest.raises(ValueError, match="cannot quantize w to Q8_0.*non-finite"):
    q8rules.quantize_params(pure, serving)
  # stacked (nn.scan) params: the layer with the nan is found too
  xs = jnp.asarray(rng.normal(size=(2, 48)), jnp.float32)
  model = ScanNet()
  params = linen_params(model, xs, rng)
  params["layers"]["fc2"]["kernel"] = params["layers"]["fc2"]["kernel"].at[2, 0, 0].set(np.nan)
  scanned = qwix.quantize_model(
    model, q8rules.Q8Provider([q8rules.Q8Rule(module_path="layers/.*")])
  )
  abstract = jax.eval_shape(scanned.init, jax.random.key(0), xs)["params"]
  with pytest.raises(ValueError, match="layers/fc2/kernel.*non-finite"):
    q8rules.quantize_params(params, abstract)


# ---- the digits benchmark, quick -----------------------------------------------------


def _benchmark():
  path = Path(__file__).resolve().parents[1] / "benchmarks" / "qat_digits.py"
  spec = importlib.util.spec_from_file_location("qat_digits", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_digits_quick():
  bench = _benchmark()
  t = time.perf_counter()
  r = bench.run(float_epochs=10, qat_epochs=1, timing_steps=20, timing_batches=(64,))
  seconds = time.perf_counter() - t
  acc = r["acc"]
  assert acc["float"] > 0.9, acc
  assert abs(acc["ptq"] - acc["float"]) <= 0.02, acc  # Q8_0 PTQ is close to float here
  assert acc["qat"] > 0.9, acc
  # served QAT model == QAT forward pass on the real task
  assert r["predictions_served_eq_qat_forward"]
  assert r["logit_rel_err_served_vs_qat_forward"] <= 1e-6
  assert 1e-5 < r["logit_rel_err_ptq_vs_float"] < 0.05
  assert "fake_quant" in r["report"]
  times = r["step_seconds"][64]
  assert 0 < times["float"] and 0 < times["qat"], times  # speed: benchmarks/RESULTS.md
  section = bench.section(r, date="today", command="pytest", seconds=seconds)
  assert section.startswith(bench.START) and section.endswith(bench.END)
  assert "## QAT on digits" in section


def test_results_section_replaces_only_its_own(tmp_path):
  bench = _benchmark()
  path = tmp_path / "RESULTS.md"
  path.write_text("# Results\n\n## Other\nkeep me\n")
  bench.write_section(f"{bench.START}\nfirst\n{bench.END}", path)
  bench.write_section(f"{bench.START}\nsecond\n{bench.END}", path)
  text = path.read_text()
  assert "keep me" in text and "second" in text and "first" not in text
  assert text.count(bench.START) == 1
