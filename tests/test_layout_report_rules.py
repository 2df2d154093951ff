"""Direct tests of `layout` (a weight as (K, N), a product as (M, K) @ (K, N)), `report` and
`rules` (Q8Rule and its validation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.layout import (
  Q8How,
  UnsupportedProduct,
  WeightLayout,
  from_dot_general,
  from_einsum,
)
from q8rules.report import OpRecord, Report
from q8rules.rules import describe, validate_rule

# ---- layout -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "spec,lhs_shape,rhs_shape",
  [
    ("btd,df->btf", (2, 3, 40), (40, 24)),  # Dense, K padded 40 -> 64
    ("btd,dnh->btnh", (2, 3, 64), (64, 4, 8)),  # attention q projection
    ("btnh,nhd->btd", (2, 3, 4, 8), (4, 8, 64)),  # output projection: two contraction axes
    ("...d,df->...f", (5, 32), (32, 7)),  # ellipsis
    ("bd,fd->bf", (3, 32), (6, 32)),  # the weight transposed: K is its last axis
    ("bted,edf->btef", (2, 3, 4, 64), (4, 64, 24)),  # dense dispatch over 4 experts
    ("ebd,efd->ebf", (4, 3, 40), (4, 8, 40)),  # experts transposed, K padded per expert
    ("bd,bdf->fb", (4, 32), (4, 32, 8)),  # one row an expert, the output transposed
  ],
)
def test_einsum_layout_round_trip(rng, spec, lhs_shape, rhs_shape):
  x = rng.standard_normal(lhs_shape).astype(np.float32)
  w = rng.standard_normal(rhs_shape).astype(np.float32)
  layout = from_einsum(spec, len(lhs_shape), rhs_shape)
  w2d = layout.weight.to_matrix(jnp.asarray(w))
  assert w2d.shape == layout.weight.stored_shape
  assert layout.weight.k_padded % 32 == 0
  np.testing.assert_array_equal(np.asarray(layout.weight.from_matrix(w2d)), w)
  y2d = layout.lhs_matrix(jnp.asarray(x)) @ w2d
  y = layout.output(y2d, lhs_shape)
  np.testing.assert_allclose(np.asarray(y), np.einsum(spec, x, w), rtol=1e-5, atol=1e-5)


def test_dot_general_layout_matches_lax():
  dn = (((2,), (0,)), ((), ()))
  layout = from_dot_general(3, (64, 16), dn)
  assert layout.weight == WeightLayout((64, 16), (0,), (1,))
  assert layout.lhs_contract == (2,) and layout.lhs_free == (0, 1)


def test_dot_general_batch_axes_are_the_weights_experts(rng):
  """A dot_general batching the weight's axes 2 and 0 with the activation's 0 and 1: the
  weight's batch axes in its own order, each expert a (K, N) matrix; the output as lax's."""
  x = rng.standard_normal((3, 2, 5, 64)).astype(np.float32)
  w = rng.standard_normal((2, 64, 3, 8)).astype(np.float32)
  dn = (((3,), (1,)), ((0, 1), (2, 0)))
  layout = from_dot_general(4, w.shape, dn)
  assert layout.weight == WeightLayout(w.shape, (1,), (3,), (0, 2))
  assert layout.lhs_batch == (1, 0) and layout.lhs_free == (2,) and layout.batched
  w2d = layout.weight.to_matrix(jnp.asarray(w))  # (2, 3, 64, 8)
  x3 = layout.lhs_matrix(jnp.asarray(x))  # (6, 5, 64)
  y3 = np.asarray(x3, np.float64) @ np.asarray(w2d, np.float64).reshape(6, 64, 8)
  ref = jax.lax.dot_general(jnp.asarray(x), jnp.asarray(w), dn, precision="highest")
  np.testing.assert_allclose(np.asarray(layout.output(y3, x.shape)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "spec,why",
  [
    ("bd,df->b", "sums an index"),
    ("bd,df", "no explicit output"),
  ],
)
def test_unsupported_einsums(spec, why):
  with pytest.raises(UnsupportedProduct, match=why):
    from_einsum(spec, 2, (32, 8))


def test_check_lhs_names_the_mismatch():
  layout = from_einsum("btd,df->btf", 3, (64, 8))
  with pytest.raises(ValueError, match=r"expecting \(64,\)"):
    layout.check_lhs((2, 3, 40))


def test_q8how_is_static_and_hashable():
  how = Q8How(WeightLayout((64, 8), (0,), (1,)), "float32", "bfloat16")
  assert hash(how) == hash(Q8How(WeightLayout((64, 8), (0,), (1,)), "float32", "bfloat16"))


# ---- report -------------------------------------------------------------------------------


def test_report_totals_and_table():
  ops = [
    OpRecord("mlp/up", "dot_general0", 0, "xla", (64, 96), 6, 64, 96, 64 * 96 * 4, 6912),
    OpRecord("attn", "einsum0", None, "float", note="no rule matched"),
    OpRecord("odd", "dot_general0", 0, "cpu", (40, 8), 1, 40, 8, 40 * 8 * 4, 576, "K padded"),
  ]
  rule = q8rules.Q8Rule(module_path="nothing")
  report = Report(ops, [rule])
  assert report.q8_bytes == 6912 + 576
  assert report.float_bytes == 64 * 96 * 4 + 40 * 8 * 4  # float bytes of quantized ops only
  assert report.paths() == {
    "mlp/up/dot_general0": "xla",
    "attn/einsum0": "float",
    "odd/dot_general0": "cpu",
  }
  text = str(report)
  assert "6x64x96" in text and "no rule matched" in text
  assert "rule matched nothing: Q8Rule(module_path='nothing')" in text
  assert "quantized weights:" in text


# ---- rules --------------------------------------------------------------------------------


def test_rule_defaults_and_describe():
  rule = q8rules.Q8Rule()
  assert rule.weight_qtype == "q8_0" and rule.implementation is None
  assert describe(q8rules.Q8Rule(module_path="mlp/.*")) == "Q8Rule(module_path='mlp/.*')"
  assert validate_rule(rule, provider="P") is rule


@pytest.mark.parametrize(
  "kwargs,message",
  [
    ({"act_qtype": "int8"}, "weight-only"),
    ({"tile_size": 64}, "always 32 rows"),
    ({"weight_qtype": "int8"}, "Q8_0 only"),
    ({"scale_dtype": jnp.bfloat16}, "float32 or float16"),
    ({"implementation": "bogus"}, "expected None, one of"),
  ],
)
def test_validate_rule_refuses(kwargs, message):
  with pytest.raises(ValueError, match=message):
    validate_rule(q8rules.Q8Rule(**kwargs), provider="Q8Provider")


@pytest.mark.parametrize(
  "kwargs,reason",
  [
    ({"act_qtype": "int8"}, "act_qtype='int8' (None, weight-only, or 'q8_0'"),
    ({"tile_size": 64}, "tile_size=64 (Q8_0 blocks are always 32 rows)"),
    ({"implementation": "bogus"}, "implementation='bogus': expected None, one of"),
    ({"scale_dtype": "not a dtype"}, "scale_dtype='not a dtype' (float32 or float16)"),
  ],
)
def test_rule_refused_at_construction_reason_first(kwargs, reason):
  """Q8Rule(...) itself raises, and the message starts with the reason, not the rule's repr."""
  with pytest.raises(ValueError) as e:
    q8rules.Q8Rule(**kwargs)
  assert str(e.value).startswith(f"Q8Rule cannot honour {reason}"), str(e.value)


def test_validate_rule_catches_a_rule_changed_after_construction():
  rule = q8rules.Q8Rule()
  object.__setattr__(rule, "tile_size", 64)
  with pytest.raises(ValueError, match="^Q8Provider cannot honour tile_size=64"):
    validate_rule(rule, provider="Q8Provider")


def test_rule_implementation_sequence():
  rule = q8rules.Q8Rule(implementation=("fold", "xla"))
  assert validate_rule(rule, provider="Q8Provider") is rule


def test_validate_rule_wants_a_q8rule():
  import qwix

  with pytest.raises(TypeError, match="takes q8rules.Q8Rule"):
    validate_rule(qwix.QuantizationRule(), provider="Q8Provider")
