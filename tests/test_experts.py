"""Expert weights under the rules: a stack of experts (E, K, N) served as Q8_0, each expert's
matrix blocked along its own K, through `jax.lax.ragged_dot` (Gemma 4's MoE form: a transposed,
reshaped gating weight) and through `w[i]` slices in a loop of einsums (Qwen 3 MoE's CPU form);
against float64 forwards of the same Q8_0 values with the routing fixed, QAT against serving."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules.q8_0 import BLOCK
from tests._utils import matrix, rel_err, weights

pytestmark = pytest.mark.usefixtures("float32_matmuls")

E, D, H, F = 4, 64, 32, 48
GROUPS = np.array([2, 0, 3, 2], np.int32)
"""Rows per expert (one expert gets none): 7 routed rows."""


class RaggedExperts(nnx.Module):
  """Gemma 4's MoE experts: gating (E, 2, H, D) transposed and reshaped to (E, D, 2H), and
  linear (E, H, D), both through `jax.lax.ragged_dot`."""

  def __init__(self, rng: np.random.Generator, dtype=jnp.float32):
    self.gating = nnx.Param(jnp.asarray(weights(rng, E, 2, H, D), dtype))
    self.linear = nnx.Param(jnp.asarray(weights(rng, E, H, D), dtype))

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    w_gate = jnp.transpose(self.gating[...], (0, 3, 1, 2)).reshape(E, D, 2 * H)
    g = jax.lax.ragged_dot(x, w_gate.astype(x.dtype), group_sizes)
    a = jax.nn.gelu(g[:, :H]) * g[:, H:]
    return jax.lax.ragged_dot(a, self.linear[...].astype(x.dtype), group_sizes)


class LoopExperts(nnx.Module):
  """Qwen 3 MoE's CPU path: a loop over experts, einsums on `gate_proj[i]` etc."""

  def __init__(self, rng: np.random.Generator, dtype=jnp.float32):
    self.gate_proj = nnx.Param(jnp.asarray(weights(rng, E, D, F), dtype))
    self.up_proj = nnx.Param(jnp.asarray(weights(rng, E, D, F), dtype))
    self.down_proj = nnx.Param(jnp.asarray(weights(rng, E, F, D), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    outs = []
    for i in range(E):
      gate = jnp.astype(self.gate_proj.value[i], x.dtype)
      up = jnp.astype(self.up_proj.value[i], x.dtype)
      a = jax.nn.silu(jnp.einsum("TD,DF->TF", x, gate)) * jnp.einsum("TD,DF->TF", x, up)
      outs.append(jnp.einsum("TF,FD->TD", a, jnp.astype(self.down_proj.value[i], x.dtype)))
    return jnp.stack(outs)


class DenseExperts(nnx.Module):
  """Mixtral-style dense dispatch: every token's input stands in each expert's slot (B, T, E, D),
  the experts run as einsums batched over their axis ('BTED,EDF->BTEF'), the down projection on
  experts stored (E, D, F) and read in the 'EBF,EDF->EBD' form."""

  def __init__(self, rng: np.random.Generator, dtype=jnp.float32):
    self.gate = nnx.Param(jnp.asarray(weights(rng, E, D, F), dtype))
    self.up = nnx.Param(jnp.asarray(weights(rng, E, D, F), dtype))
    self.down = nnx.Param(jnp.asarray(weights(rng, E, D, F), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, e, _ = x.shape
    g = jnp.einsum("BTED,EDF->BTEF", x, self.gate[...].astype(x.dtype))
    u = jnp.einsum("BTED,EDF->BTEF", x, self.up[...].astype(x.dtype))
    a = jnp.moveaxis((jax.nn.silu(g) * u).reshape(b * t, e, F), 1, 0)
    return jnp.einsum("EBF,EDF->EBD", a, self.down[...].astype(x.dtype))


def dense_f64(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
  """`DenseExperts` in float64 (the silu in float32 on float64 pre-activations)."""
  g = np.einsum("BTED,EDF->BTEF", x, gate)
  a = np.asarray(jax.nn.silu(jnp.asarray(g, jnp.float32)), np.float64)
  a = a * np.einsum("BTED,EDF->BTEF", x, up)
  b, t = x.shape[:2]
  return np.einsum("EBF,EDF->EBD", np.moveaxis(a.reshape(b * t, E, F), 1, 0), down)


def experts_f64(w) -> np.ndarray:
  """A served stack of experts back in its float shape (E, ...), in float64 (numpy only)."""
  layout = w.how.layout
  q = np.asarray(w.array.q, np.float64)  # (E, K_pad, N)
  d = np.repeat(np.asarray(w.array.scale, np.float64), BLOCK, axis=1)
  order = layout.batch + layout.contract + layout.free
  moved = (q * d)[:, : layout.k].reshape([layout.shape[a] for a in order])
  return np.transpose(moved, np.argsort(order))


def gelu64(x: np.ndarray) -> np.ndarray:
  return np.asarray(jax.nn.gelu(jnp.asarray(x, jnp.float64 if jax.config.x64_enabled else None)))


def ragged_f64(x: np.ndarray, w: np.ndarray, groups: np.ndarray) -> np.ndarray:
  """ragged_dot in float64: rows of x sorted by group, w (G, K, N)."""
  out, start = [], 0
  for g, size in enumerate(groups):
    out.append(x[start : start + size] @ w[g])
    start += size
  return np.concatenate(out)


def provider() -> q8rules.Q8Provider:
  return q8rules.Q8Provider([q8rules.Q8Rule(module_path=".*")])


def test_ragged_dot_experts_are_served_as_q8_0():
  rng = np.random.default_rng(0)
  model = RaggedExperts(rng)
  x = jnp.asarray(rng.standard_normal((int(GROUPS.sum()), D)), jnp.float32)
  gs = jnp.asarray(GROUPS)
  p = provider()
  served = qwix.quantize_model(model, p, x, gs)
  for name, shape in (("gating", (E, D, 2 * H)), ("linear", (E, H, D))):
    w = getattr(served, name)
    w = w.value if isinstance(w, nnx.Variable) else w
    assert np.dtype(w.array.q.dtype) == np.int8
    assert tuple(w.array.q.shape) == (E, -(-shape[1] // BLOCK) * BLOCK, shape[2]), name
  floats = [
    (path, leaf.shape)
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(served))
    if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 2 and leaf.shape[-2] > BLOCK
  ]
  assert floats == []  # no float copy of an expert weight stays resident
  out = served(x, gs)
  gate = np.transpose(experts_f64(served.gating.value), (0, 3, 1, 2)).reshape(E, D, 2 * H)
  g = ragged_f64(np.asarray(x, np.float64), gate, GROUPS)
  a = np.asarray(jax.nn.gelu(jnp.asarray(g[:, :H], jnp.float32)), np.float64) * g[:, H:]
  # the gelu in float32 on the float64 pre-activations: the product is what is checked here
  ref = ragged_f64(a, experts_f64(served.linear.value), GROUPS)
  assert rel_err(out, ref) <= 1e-5
  paths = {r.op: r.path for r in p.report().ops}
  assert all(path in q8rules.kernels.RAGGED_IMPLEMENTATIONS for path in paths.values()), paths
  assert jnp.allclose(jax.jit(lambda x: served(x, gs))(x), out, rtol=1e-6, atol=1e-6)


def test_expert_slices_are_served_as_q8_0():
  rng = np.random.default_rng(1)
  model = LoopExperts(rng)
  x = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
  p = provider()
  served = qwix.quantize_model(model, p, x)
  for name in ("gate_proj", "up_proj", "down_proj"):
    assert np.dtype(getattr(served, name).value.array.q.dtype) == np.int8
  out = np.asarray(served(x), np.float64)
  gate = experts_f64(served.gate_proj.value)
  up = experts_f64(served.up_proj.value)
  down = experts_f64(served.down_proj.value)
  x64 = np.asarray(x, np.float64)
  for i in range(E):
    h1, h2 = x64 @ gate[i], x64 @ up[i]
    a = np.asarray(jax.nn.silu(jnp.asarray(h1, jnp.float32)), np.float64) * h2
    assert rel_err(out[i], a @ down[i]) <= 1e-5, i
  report = p.report()
  assert len(report.ops) == 3 * E
  assert all(r.q8_bytes for r in report.ops)


@pytest.mark.parametrize("model_type", matrix([RaggedExperts, LoopExperts], RaggedExperts))
def test_qat_on_experts_is_the_served_model(model_type):
  rng = np.random.default_rng(2)
  float_model = model_type(np.random.default_rng(3))
  if model_type is RaggedExperts:
    x = jnp.asarray(rng.standard_normal((int(GROUPS.sum()), D)), jnp.float32)
    args = (x, jnp.asarray(GROUPS))
  else:
    args = (jnp.asarray(rng.standard_normal((3, D)), jnp.float32),)
  served = qwix.quantize_model(model_type(np.random.default_rng(3)), provider(), *args)
  qat = qwix.quantize_model(
    float_model, q8rules.Q8QatProvider([q8rules.Q8Rule(module_path=".*")]), *args
  )
  assert np.array_equal(np.asarray(qat(*args)), np.asarray(served(*args)))

  def loss(m, *a):
    return jnp.sum(m(*a) ** 2)

  grads = nnx.grad(loss)(qat, *args)
  for name, g in nnx.to_flat_state(grads):
    assert np.all(np.isfinite(np.asarray(g[...]))), name
    assert np.abs(np.asarray(g[...])).sum() > 0, name


class OneRagged(nnx.Module):
  """One grouped product on experts stored (E, N, K) and used transposed: y = ragged_dot(x, w^T)."""

  def __init__(self, rng: np.random.Generator):
    self.w = nnx.Param(jnp.asarray(weights(rng, E, F, D)))

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, jnp.transpose(self.w[...], (0, 2, 1)), group_sizes)


def test_qat_gradients_on_experts_against_float64():
  """d/dx and d/dw of sum(c * ragged_dot(x, fake_quant(w)^T)) with the straight-through
  estimator, against float64."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((int(GROUPS.sum()), D)), jnp.float32)
  c = rng.standard_normal((int(GROUPS.sum()), F))
  gs = jnp.asarray(GROUPS)
  qat = qwix.quantize_model(
    OneRagged(np.random.default_rng(6)), q8rules.Q8QatProvider([q8rules.Q8Rule()]), x, gs
  )
  served = qwix.quantize_model(OneRagged(np.random.default_rng(6)), provider(), x, gs)
  wq = np.transpose(experts_f64(served.w[...]), (0, 2, 1))  # (E, D, F): the values QAT uses

  def loss(m, x):
    return jnp.sum(jnp.asarray(c, jnp.float32) * m(x, gs))

  dm, dx = nnx.grad(loss, argnums=(0, 1))(qat, x)
  x64, start = np.asarray(x, np.float64), 0
  dx_ref, dw_ref = np.zeros_like(x64), np.zeros((E, F, D))
  for g, size in enumerate(GROUPS):
    rows = slice(start, start + size)
    dx_ref[rows] = c[rows] @ wq[g].T
    dw_ref[g] = (x64[rows].T @ c[rows]).T
    start += size
  assert rel_err(dx, dx_ref) <= 1e-5
  assert rel_err(dm.w[...], dw_ref) <= 1e-5


def test_group_sizes_that_do_not_sum_to_the_rows_are_refused():
  rng = np.random.default_rng(4)
  model = RaggedExperts(rng)
  x = jnp.asarray(rng.standard_normal((7, D)), jnp.float32)
  served = qwix.quantize_model(model, provider(), x, jnp.asarray(GROUPS))
  with pytest.raises(ValueError, match=r"group_sizes sum to 6, but x has M=7"):
    served(x, jnp.asarray([2, 0, 2, 2], jnp.int32))


class Side(nnx.Module):
  """A module whose one weight is used outside any product (added), beside a product of two
  activations."""

  def __init__(self, rng: np.random.Generator):
    self.offset = nnx.Param(jnp.asarray(weights(rng, 3, D)))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = x + self.offset[...].sum(0)
    return jnp.einsum("TD,SD->TS", y, y)


class Routed(nnx.Module):
  """A router (float, as llama.cpp keeps `ffn_gate_inp`), a projection scaled by a constant
  (Gemma 4's per-layer projection: `w * c` before its einsum) and a module whose weight is used
  outside any product."""

  def __init__(self, rng: np.random.Generator):
    self.router = nnx.Linear(D, E, use_bias=False, rngs=nnx.Rngs(0))
    self.router.kernel[...] = jnp.asarray(weights(rng, D, E))
    self.proj = nnx.Param(jnp.asarray(weights(rng, D, F)))
    self.side = Side(rng)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = self.router(x) + self.side(x).sum()
    return logits, jnp.einsum("TD,DF->TF", x, self.proj[...] * 0.125)


def test_router_stays_float_and_every_float_weight_is_reported():
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
  p = provider()
  with pytest.warns(UserWarning, match=r"matched side but served none of its weights") as w:
    served = qwix.quantize_model(Routed(rng), p, x)
  assert not any("router" in str(m.message) for m in w)  # kept float on purpose: reported only
  assert isinstance(served.router.kernel[...], jax.Array)  # float, as llama.cpp keeps routers
  reasons = {f.path: f.reason for f in p.report().float_params}
  assert set(reasons) == {"router/kernel", "side/offset"}, reasons
  assert "router" in reasons["router/kernel"] and "llama.cpp" in reasons["router/kernel"]
  assert "through an op q8rules does not carry" in reasons["side/offset"]
  assert "left float: side/offset 3x64" in str(p.report())


def test_keep_float_empty_serves_routers_and_constant_factors():
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
  p = q8rules.Q8Provider([q8rules.Q8Rule(module_path=".*", keep_float=())])
  model = Routed(np.random.default_rng(10))
  served = qwix.quantize_model(model, p, x)
  router = served.router.kernel[...]
  assert np.dtype(router.array.q.dtype) == np.int8
  logits, y = served(x)
  proj = served.proj[...]
  q = np.asarray(proj.array.q, np.float64) * np.repeat(np.asarray(proj.array.scale), BLOCK, 0)
  assert rel_err(y, np.asarray(x, np.float64) @ q[:D] * 0.125) <= 1e-5
  qat = qwix.quantize_model(
    Routed(np.random.default_rng(10)),
    q8rules.Q8QatProvider([q8rules.Q8Rule(module_path=".*", keep_float=())]),
    x,
  )
  assert np.array_equal(np.asarray(qat(x)[1]), np.asarray(y))


def test_keep_float_is_validated():
  with pytest.raises(ValueError, match=r"keep_float regex '\('"):
    q8rules.Q8Rule(keep_float=("(",))
  with pytest.raises(ValueError, match=r"keep_float='router'"):
    q8rules.Q8Rule(keep_float="router")


def test_einsum_batched_over_experts_is_served_as_q8_0():
  """The dense dispatch's einsums batched over the expert axis: each expert's (K, N) matrix
  Q8_0 along its own K, served through op 'ragged_matmul' (each expert's rows its group), against
  float64 on the same values; jit as eager; no float copy of an expert weight resident."""
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((2, 3, E, D)), jnp.float32)
  p = provider()
  served = qwix.quantize_model(DenseExperts(np.random.default_rng(12)), p, x)
  stacks = {n: getattr(served, n)[...] for n in ("gate", "up", "down")}
  for name, w in stacks.items():
    assert np.dtype(w.array.q.dtype) == np.int8 and w.how.layout.batch == (0,), name
  assert stacks["down"].how.layout.contract == (2,)  # 'EDF' read as K = F
  out = served(x)
  ref = dense_f64(np.asarray(x, np.float64), *(experts_f64(w) for w in stacks.values()))
  assert rel_err(out, ref) <= 1e-5
  assert rel_err(jax.jit(served)(x), ref) <= 1e-5
  report = p.report()
  assert [r.path in q8rules.kernels.RAGGED_IMPLEMENTATIONS for r in report.ops] == [True] * 3
  assert report.float_params == []
  assert [r.float_bytes for r in report.ops] == [E * D * F * 4] * 3


def test_dot_general_batched_over_experts_in_bfloat16():
  """`lax.dot_general` with the expert axis a batch axis, bfloat16 weights and activations:
  within bfloat16's rounding of the float64 product on the same Q8_0 values."""

  class Batched(nnx.Module):
    def __init__(self, rng: np.random.Generator):
      self.w = nnx.Param(jnp.asarray(weights(rng, E, F, D), jnp.bfloat16))

    def __call__(self, x: jax.Array) -> jax.Array:  # x (E, T, F) -> (E, T, D)
      return jax.lax.dot_general(x, self.w[...], (((2,), (1,)), ((0,), (0,))))

  rng = np.random.default_rng(13)
  x = jnp.asarray(rng.standard_normal((E, 5, F)), jnp.bfloat16)
  served = qwix.quantize_model(Batched(rng), provider(), x)
  out = served(x)
  assert out.dtype == jnp.bfloat16
  ref = np.einsum("ETF,EFD->ETD", np.asarray(x, np.float64), experts_f64(served.w[...]))
  assert rel_err(out, ref) <= 1e-2


@pytest.mark.slow
def test_qat_on_batched_experts_is_served_and_its_gradients_are_float64s():
  """QAT on the dense dispatch: the forward is the served model bit for bit (eagerly, and
  within 1e-6 jitted); d/dx and d/dw of sum(c * out) with the straight-through estimator
  against float64 on the Q8_0 round trip."""
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.standard_normal((2, 3, E, D)), jnp.float32)
  c = rng.standard_normal((E, 6, D))
  served = qwix.quantize_model(DenseExperts(np.random.default_rng(15)), provider(), x)
  qat = qwix.quantize_model(
    DenseExperts(np.random.default_rng(15)), q8rules.Q8QatProvider([q8rules.Q8Rule()]), x
  )
  want = served(x)
  assert np.array_equal(np.asarray(qat(x)), np.asarray(want))
  assert rel_err(nnx.jit(lambda m, x: m(x))(qat, x), want) <= 1e-6

  def loss(m, x):
    return jnp.sum(jnp.asarray(c, jnp.float32) * m(x))

  dm, dx = nnx.grad(loss, argnums=(0, 1))(qat, x)
  with jax.enable_x64(True):
    x64 = jnp.asarray(x, jnp.float64)
    w64 = {n: jnp.asarray(experts_f64(getattr(served, n)[...])) for n in ("gate", "up", "down")}

    def loss64(w, x):
      g = jnp.einsum("BTED,EDF->BTEF", x, w["gate"])
      a = jax.nn.silu(g) * jnp.einsum("BTED,EDF->BTEF", x, w["up"])
      a = jnp.moveaxis(a.reshape(6, E, F), 1, 0)
      return jnp.sum(jnp.asarray(c) * jnp.einsum("EBF,EDF->EBD", a, w["down"]))

    dw_ref, dx_ref = jax.grad(loss64, argnums=(0, 1))(w64, x64)
  assert rel_err(dx, dx_ref) <= 1e-5
  for name in ("gate", "up", "down"):
    assert rel_err(getattr(dm, name)[...], dw_ref[name]) <= 1e-5, name


class Factored(nnx.Module):
  """Weights times array factors before their products: a dense weight by a vector along N
  (`w * c`, `c * w`, `w / c`), a stack of experts by one factor per expert and column through
  `jax.lax.ragged_dot`, an einsum batched over experts, and `w[i]` slices."""

  def __init__(self, rng: np.random.Generator):
    self.w = nnx.Param(jnp.asarray(weights(rng, D, F)))
    self.experts = nnx.Param(jnp.asarray(weights(rng, E, D, F)))
    self.c = jnp.asarray(rng.uniform(0.5, 2.0, F), jnp.float32)
    self.per_expert = jnp.asarray(rng.uniform(0.5, 2.0, (E, 1, F)), jnp.float32)

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> list[jax.Array]:
    w, c, s = self.w[...], self.c, self.per_expert
    stack = self.experts[...]
    return [
      jnp.dot(x, w * c),
      jnp.dot(x, c * w),
      jnp.einsum("TD,DF->TF", x, w / c),
      jax.lax.ragged_dot(x, stack * s, group_sizes),
      jnp.einsum("ETD,EDF->ETF", jnp.broadcast_to(x, (E, *x.shape)), stack / s),
      jnp.einsum("TD,DF->TF", x, (stack * s)[2]),
    ]


def test_array_factors_along_n_are_served_exactly():
  """Each product against float64 on the param's own Q8_0 values, the factor applied to the
  output columns (x @ (w * c) = (x @ w) * c); QAT's forward is the served model's."""
  rng = np.random.default_rng(16)
  x = jnp.asarray(rng.standard_normal((int(GROUPS.sum()), D)), jnp.float32)
  gs = jnp.asarray(GROUPS)
  p = provider()
  served = qwix.quantize_model(Factored(np.random.default_rng(17)), p, x, gs)
  outs = served(x, gs)
  q8 = served.w[...].array
  w = (np.asarray(q8.q, np.float64) * np.repeat(np.asarray(q8.scale, np.float64), BLOCK, 0))[:D]
  stack = experts_f64(served.experts[...])
  c, s = np.asarray(served.c, np.float64), np.asarray(served.per_expert, np.float64)
  x64 = np.asarray(x, np.float64)
  refs = [
    x64 @ w * c,
    x64 @ w * c,
    x64 @ w / c,
    ragged_f64(x64, stack * s, GROUPS),
    np.einsum("TD,EDF->ETF", x64, stack / s),
    x64 @ (stack * s)[2],
  ]
  for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
    assert rel_err(out, ref) <= 1e-5, i
  assert all(r.path != "float" for r in p.report().ops), p.report()
  assert p.report().float_params == []
  for got, ref in zip(jax.jit(served)(x, gs), refs, strict=True):
    assert rel_err(got, ref) <= 1e-5
  qat = qwix.quantize_model(
    Factored(np.random.default_rng(17)), q8rules.Q8QatProvider([q8rules.Q8Rule()]), x, gs
  )
  for got, want in zip(qat(x, gs), outs, strict=True):
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_a_factor_along_k_is_refused_naming_the_weight():
  class AlongK(nnx.Module):
    def __init__(self, rng: np.random.Generator):
      self.proj = nnx.Param(jnp.asarray(weights(rng, D, F)))

    def __call__(self, x: jax.Array) -> jax.Array:
      return jnp.dot(x, self.proj[...] * jnp.linspace(0.5, 1.5, D)[:, None])

  x = jnp.ones((2, D), jnp.float32)
  with pytest.raises(TypeError, match=r"weight proj of float shape \(64, 48\).*contracted axes"):
    qwix.quantize_model(AlongK(np.random.default_rng(18)), provider(), x)


def _shapes(jaxpr) -> set[tuple[int, ...]]:
  """The shapes of every value a jaxpr computes, its inner jaxprs' included."""
  out = set()
  for eqn in jaxpr.eqns:
    out |= {tuple(v.aval.shape) for v in eqn.outvars}
    for p in eqn.params.values():
      for inner in p if isinstance(p, tuple | list) else (p,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          out |= _shapes(inner)
  return out


@pytest.mark.slow
def test_qat_on_expert_slices_quantizes_one_expert_and_its_gradients_are_float64s():
  """QAT on `w[i]` slices: each product quantizes expert i alone (no scales of the whole stack
  in the program), and d/dx, d/dw of sum(c * out) are float64's on the Q8_0 round trip."""
  rng = np.random.default_rng(22)
  x = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
  c = rng.standard_normal((E, 3, D))
  qat = qwix.quantize_model(
    LoopExperts(np.random.default_rng(23)), q8rules.Q8QatProvider([q8rules.Q8Rule()]), x
  )
  served = qwix.quantize_model(LoopExperts(np.random.default_rng(23)), provider(), x)
  shapes = _shapes(jax.make_jaxpr(lambda x: qat(x))(x).jaxpr)
  assert (E, D // BLOCK, F) not in shapes and (E, F // BLOCK, D) not in shapes
  assert (D // BLOCK, F) in shapes  # one expert's scales

  def loss(m, x):
    return jnp.sum(jnp.asarray(c, jnp.float32) * m(x))

  dm, dx = nnx.grad(loss, argnums=(0, 1))(qat, x)
  with jax.enable_x64(True):
    w = {n: jnp.asarray(experts_f64(getattr(served, n).value)) for n in ("gate_proj", "up_proj")}
    w["down_proj"] = jnp.asarray(experts_f64(served.down_proj.value))

    def loss64(w, x):
      out = []
      for i in range(E):
        a = jax.nn.silu(x @ w["gate_proj"][i]) * (x @ w["up_proj"][i])
        out.append(a @ w["down_proj"][i])
      return jnp.sum(jnp.asarray(c) * jnp.stack(out))

    dw_ref, dx_ref = jax.grad(loss64, argnums=(0, 1))(w, jnp.asarray(x, jnp.float64))
  assert rel_err(dx, dx_ref) <= 1e-5
  for name in ("gate_proj", "up_proj", "down_proj"):
    assert rel_err(getattr(dm, name)[...], dw_ref[name]) <= 1e-5, name
