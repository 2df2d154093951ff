"""The transposed Q8_0 product, op 'matmul_t' (dy @ W^T, the gradient of x @ W in x): every
implementation against float64 on fresh random data, the weight-only product's gradient through
it under jit, vmap, remat, scan and a mesh, no whole float weight in the XLA path, its errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from q8rules import sharding
from q8rules.kernels import (
  IMPLEMENTATIONS,
  OPS,
  q8_fold,
  q8_matmul,
  q8_matmul_t,
  why_not,
)
from q8rules.kernels.layer import LayerSlice
from q8rules.kernels.matmul_t import api
from q8rules.kernels.matmul_t.reference import reference_float64
from q8rules.kernels.matmul_t.xla import q8_matmul_t_xla
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd
from q8rules.q8_0 import BLOCK, Q8Array
from tests._utils import rel_err
from tests.test_fold import GPU_CASES, TPU_CASES

TOL = 1e-5
"""||out - ref|| / ||ref|| against float64, float32 accumulation."""

# tests/test_fold.py's products, and more rows than a decode tile takes.
CASES = [*TPU_CASES, *GPU_CASES, (40, 1024, 128), (64, 2048, 40)]

T_IMPLEMENTATIONS = api.IMPLEMENTATIONS


def operands(rng: np.random.Generator, m: int, k: int, n: int, scale_dtype=np.float32):
  """Fresh dy (m, N) f32 normal, q (K, N) int8 over [-127, 127] (never all zero), scale
  (K/32, N) > 0 over three decades."""
  dy = rng.standard_normal((m, n)).astype(np.float32)
  q = rng.integers(-127, 128, (k, n)).astype(np.int8)
  scale = (rng.uniform(0.5, 2.0, (k // BLOCK, n)) * 10.0 ** rng.uniform(-4, -1)).astype(scale_dtype)
  return dy, q, scale


def weight(q, scale) -> Q8Array:
  return Q8Array(jnp.asarray(q), jnp.asarray(scale))


def runnable(name: str) -> bool:
  from q8rules.kernels.matmul_t.problem import TransposedProblem

  p = TransposedProblem.of(1, 32, 32, jnp.float32)
  return OPS["matmul_t"].implementations[name].cannot(p) is None


# ---- the op against float64 -------------------------------------------------------------


@pytest.mark.parametrize("name", T_IMPLEMENTATIONS)
@pytest.mark.parametrize("m,k,n", CASES)
def test_matches_float64(rng, name, m, k, n):
  if not runnable(name):
    pytest.skip(f"{name} cannot run here")
  dy, q, scale = operands(rng, m, k, n)
  y = jax.jit(lambda d: q8_matmul_t(d, weight(q, scale), implementation=name))(dy)
  assert y.shape == (m, k) and y.dtype == jnp.float32
  assert rel_err(y, reference_float64(dy, q, scale)) <= TOL


@pytest.mark.parametrize("name", T_IMPLEMENTATIONS)
@pytest.mark.parametrize("m,k,n", [(3, 1024, 40), (8, 2048, 384)])
def test_bfloat16_cotangents_and_float16_scales(rng, name, m, k, n):
  """bf16 dy is exact in float32: the float32 output is held to float64 of the rounded dy."""
  if not runnable(name):
    pytest.skip(f"{name} cannot run here")
  dy, q, scale = operands(rng, m, k, n, scale_dtype=np.float16)
  dyb = jnp.asarray(dy, jnp.bfloat16)
  w = weight(q, scale)
  y = q8_matmul_t(dyb, w, implementation=name, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  assert rel_err(y, reference_float64(np.asarray(dyb, np.float32), q, scale)) <= TOL
  assert q8_matmul_t(dyb, w, implementation=name).dtype == jnp.bfloat16


def test_native_paths(rng, cpu_isa):
  """Each SIMD path the CPU has (capped by $Q8RULES_CPU_ISA), N with a tail past the lanes,
  rows in several tiles and enough work for the threads."""
  for m, k, n in [(11, 2048, 200), (1, 64, 7), (17, 4096, 512)]:
    dy, q, scale = operands(rng, m, k, n, scale_dtype=np.float16 if m == 1 else np.float32)
    # Dispatch is asynchronous: the call must have run before "last" can name its path.
    y = jax.block_until_ready(q8_matmul_t(jnp.asarray(dy), weight(q, scale), implementation="cpu"))
    assert native_simd.isa("last") == cpu_isa
    assert rel_err(y, reference_float64(dy, q, scale)) <= TOL, (cpu_isa, m, k, n)


def test_batched_cotangents_and_empty(rng):
  dy, q, scale = operands(rng, 6, 256, 96)
  w = weight(q, scale)
  y = q8_matmul_t(jnp.asarray(dy).reshape(2, 3, 96), w)
  assert y.shape == (2, 3, 256)
  assert rel_err(y.reshape(6, 256), reference_float64(dy, q, scale)) <= TOL
  assert q8_matmul_t(jnp.zeros((0, 96)), w).shape == (0, 256)


# ---- the weight-only product's gradient in x runs through it -----------------------------


def grad_x(name: str, w: Q8Array, x: np.ndarray, cot: np.ndarray) -> jax.Array:
  def loss(x):
    return jnp.sum(q8_matmul(x, w, implementation=name) * cot)

  return jax.jit(jax.grad(loss))(jnp.asarray(x))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("m,k,n", CASES)
def test_grad_of_q8_matmul_matches_float64(rng, name, m, k, n):
  if (reason := why_not(name, m, k, n, jnp.float32)) is not None:
    pytest.skip(f"{name} cannot run here: {reason}")
  cot, q, scale = operands(rng, m, k, n)
  x = rng.standard_normal((m, k)).astype(np.float32)
  dx = grad_x(name, weight(q, scale), x, cot)
  assert dx.shape == (m, k) and dx.dtype == jnp.float32
  assert rel_err(dx, reference_float64(cot, q, scale)) <= TOL


def test_the_gradient_program_calls_the_native_kernel(rng):
  """On the CPU the gradient in x of every implementation but 'xla' and 'reference' lowers to
  the native transposed kernel; 'xla' keeps to XLA."""
  if not native_lib.available():
    pytest.skip(native_lib.unavailable_reason())
  cot, q, scale = operands(rng, 3, 256, 64)
  w = weight(q, scale)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
  for name, native in [("cpu", True), ("fold", True), ("xla_dequant", True), ("xla", False)]:
    lowered = jax.jit(jax.grad(lambda x, i=name: jnp.sum(q8_matmul(x, w, implementation=i) * cot)))
    text = lowered.lower(x).as_text()
    assert (native_lib.TARGET_MATMUL_T in text) == native, name


def test_fold_gradient(rng):
  """`q8_fold`'s own custom_vjp: dx by this op, dscale by the XLA scan's transpose."""
  m, k, n = 3, 1024, 40
  cot, q, scale = operands(rng, m, k, n)
  x = rng.standard_normal((m, k)).astype(np.float32)
  dx, ds = jax.grad(lambda x, s: jnp.sum(q8_fold(x, q, s) * cot), argnums=(0, 1))(x, scale)
  assert rel_err(dx, reference_float64(cot, q, scale)) <= TOL
  xb = x.astype(np.float64).reshape(m, k // BLOCK, BLOCK)
  ref_ds = np.einsum("rbi,bin,rn->bn", xb, q.reshape(k // BLOCK, BLOCK, n).astype(np.float64), cot)
  assert rel_err(ds, ref_ds) <= TOL


def test_bfloat16_gradient_keeps_the_dtype(rng):
  cot, q, scale = operands(rng, 4, 512, 64)
  x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
  dx = grad_x(None, weight(q, scale), x, cot)
  assert dx.dtype == jnp.bfloat16
  assert rel_err(dx, reference_float64(cot, q, scale)) <= 1e-2  # one bf16 rounding


@pytest.mark.parametrize("name", ["cpu", "xla", "fold", "reference"])
def test_grad_under_remat_and_vmap(rng, name):
  m, k, n = 2, 512, 96  # vmap folds the batch of 3 into 6 rows: within the fold's tile
  if (reason := why_not(name, m, k, n, jnp.float32)) is not None:
    pytest.skip(reason)
  cot, q, scale = operands(rng, m, k, n)
  w = weight(q, scale)
  xs = rng.standard_normal((3, m, k)).astype(np.float32)

  @jax.checkpoint
  def layer(x):
    return jnp.tanh(q8_matmul(x, w, implementation=name))

  def loss(x):
    return jnp.sum(layer(x) * cot)

  dxs = jax.jit(jax.vmap(jax.grad(loss)))(xs)
  for x, dx in zip(xs, dxs, strict=True):
    y = x.astype(np.float64) @ (q.astype(np.float64) * np.repeat(scale.astype(np.float64), 32, 0))
    ref = reference_float64(cot * (1 - np.tanh(y) ** 2), q, scale)
    assert rel_err(dx, ref) <= TOL


@pytest.mark.parametrize("name", ["cpu", "xla", "fold", "reference"])
def test_grad_inside_scan_over_stacked_layers(rng, name):
  """`lax.scan` over stacked weights (the layer product, `LayerSlice`): the gradient in x is
  the sum of each layer's transposed product."""
  layers, m, k, n = 3, 2, 256, 64
  if (reason := why_not(name, m, k, n, jnp.float32)) is not None:
    pytest.skip(reason)
  parts = [operands(rng, m, k, n) for _ in range(layers)]
  stacked = Q8Array(jnp.stack([p[1] for p in parts]), jnp.stack([p[2] for p in parts]))
  cots = jnp.stack([p[0] for p in parts])
  x = rng.standard_normal((m, k)).astype(np.float32)

  def loss(x):
    def step(total, i):
      y = q8_matmul(x, LayerSlice(stacked, i), implementation=name)
      return total + jnp.sum(y * cots[i]), None

    total, _ = jax.lax.scan(step, 0.0, jnp.arange(layers, dtype=jnp.int32))
    return total

  dx = jax.jit(jax.grad(loss))(x)
  ref = sum(reference_float64(c, q, s) for c, q, s in parts)
  assert rel_err(dx, ref) <= TOL


def test_second_order(rng):
  """`jax.jvp` of the gradient (a Hessian-vector product) runs the op's JVP and transpose:
  for loss = sum((x W)^2), H v = 2 (v W) W^T."""
  m, k, n = 2, 256, 64
  _, q, scale = operands(rng, m, k, n)
  w = weight(q, scale)
  x, v = (rng.standard_normal((m, k)).astype(np.float32) for _ in range(2))

  def grad(x):
    return jax.grad(lambda x: jnp.sum(q8_matmul(x, w) ** 2))(x)

  _, hv = jax.jvp(grad, (x,), (v,))
  w64 = q.astype(np.float64) * np.repeat(scale.astype(np.float64), BLOCK, 0)
  assert rel_err(hv, 2 * (v.astype(np.float64) @ w64) @ w64.T) <= TOL
  # and the op's own gradient in dy is the forward product
  dy = rng.standard_normal((m, n)).astype(np.float32)
  ddy = jax.grad(lambda d: jnp.sum(q8_matmul_t(d, w) * v))(dy)
  assert rel_err(ddy, v.astype(np.float64) @ w64) <= TOL


@pytest.mark.parametrize("spec", [P(None, "tp"), P("tp", None)])
def test_grad_on_a_mesh(rng, spec):
  """The sharded product's gradient in x, column- and row-parallel over 8 devices."""
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices; the backend has {len(jax.devices())}")
  mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
  m, k, n = 4, 512, 256
  cot, q, scale = operands(rng, m, k, n)
  w = sharding.shard_q8(weight(q, scale), mesh, spec)
  x = rng.standard_normal((m, k)).astype(np.float32)

  def loss(x):
    return jnp.sum(sharding.q8_matmul_sharded(x, w, mesh, w_spec=spec) * cot)

  dx = jax.jit(jax.grad(loss))(x)
  assert rel_err(dx, reference_float64(cot, q, scale)) <= TOL


# ---- no whole float weight ----------------------------------------------------------------


def float_weights(text: str, k: int, n: int) -> list[str]:
  """The (K, N) and (N, K) float arrays a compiled program's HLO names."""
  return re.findall(rf"f(?:32|64|16)\[(?:{k},{n}|{n},{k})\]", text)


def test_xla_path_never_holds_the_float_weight(rng):
  m, k, n = 3, 4096, 512
  dy, q, scale = operands(rng, m, k, n)
  w = weight(q, scale)
  for name in ("xla", "reference"):
    text = jax.jit(lambda d, i=name: q8_matmul_t(d, w, implementation=i)).lower(dy).compile()
    found = float_weights(text.as_text(), k, n)
    assert bool(found) == (name == "reference"), (name, found)  # the reference builds it
  x = rng.standard_normal((m, k)).astype(np.float32)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(q8_matmul(x, w, implementation="xla") * dy)))
  assert float_weights(grad.lower(x).compile().as_text(), k, n) == []
  assert rel_err(q8_matmul_t_xla(dy, q, scale, chunk=96), reference_float64(dy, q, scale)) <= TOL


# ---- registry and errors ------------------------------------------------------------------


def test_registered_with_orders_and_reasons():
  op = OPS["matmul_t"]
  assert op.names == ("cpu", "xla", "reference")
  assert api.resolve_t(1, 4096, 4096, backend="tpu") == "xla"
  assert api.resolve_t(1, 4096, 4096, backend="gpu") == "xla"
  if native_lib.available():
    assert api.resolve_t(16, 4096, 4096, backend="cpu") == "cpu"
  assert api.resolve_t(17, 4096, 4096, backend="cpu") == "xla"  # XLA's GEMM is faster there
  with pytest.raises(ValueError, match=r"'cpu': the native CPU kernel runs on the CPU only"):
    api.resolve_t(1, 4096, 4096, backend="tpu", implementation="cpu")
  assert api.resolve_t(1, 64, 64, backend="tpu", implementation=("cpu", "xla")) == "xla"
  assert api.backward_implementation("fold") is None
  assert api.backward_implementation(("cpu", "xla_dequant", "xla")) == ("cpu", "xla")


def test_errors_name_the_op(rng):
  dy, q, scale = operands(rng, 2, 64, 48)
  w = weight(q, scale)
  with pytest.raises(ValueError, match=r"q8_matmul_t: cotangents of shape \(2, 47\) do not"):
    q8_matmul_t(jnp.zeros((2, 47)), w)
  with pytest.raises(TypeError, match="q8_matmul_t: cotangents must be float32"):
    q8_matmul_t(jnp.zeros((2, 48), jnp.int32), w)
  with pytest.raises(TypeError, match="q8_matmul_t: the weight must be a Q8Array"):
    q8_matmul_t(jnp.asarray(dy), jnp.zeros((64, 48)))
  with pytest.raises(ValueError, match=r"q8_matmul_t: scale shape \(1, 48\) does not match"):
    q8_matmul_t(jnp.asarray(dy), Q8Array(jnp.asarray(q), jnp.asarray(scale[:1])))
  with pytest.raises(ValueError, match=r"implementation='fold': expected None, one of"):
    q8_matmul_t(jnp.asarray(dy), w, implementation="fold")


def test_xla_and_reference_dots_are_float32_precision(rng):
  """The op's dots, and those of the 'xla' product's gradient, run at HIGHEST (IEEE float32 on
  a GPU too, not TF32)."""
  dy, q, scale = operands(rng, 3, 256, 64)
  w = weight(q, scale)
  x = rng.standard_normal((3, 256)).astype(np.float32)
  programs = [
    (jax.jit(lambda d, i=i: q8_matmul_t(d, w, implementation=i)), dy) for i in ("xla", "reference")
  ]
  grad = jax.grad(lambda x: jnp.sum(q8_matmul(x, w, implementation="xla") * dy))
  for fn, arg in [*programs, (jax.jit(grad), x)]:
    lines = [line for line in fn.lower(arg).as_text().splitlines() if "dot_general" in line]
    assert lines and all("HIGHEST" in line for line in lines), lines


@pytest.mark.parametrize("m", [3, 40])
def test_xla_a_nan_or_inf_in_dy_stays_in_its_rows(rng, m):
  """The 'xla' slabs wait for dy (their scales take a zero from dy's first value): a NaN or an
  infinity there reaches only its own row of the output, every other row is the product."""
  k, n = 64, 96
  dy, q, scale = operands(rng, m, k, n)
  dy = np.array(dy)
  dy[0, 0], dy[1, 5] = np.nan, np.inf
  out = np.asarray(q8_matmul_t_xla(jnp.asarray(dy), q, scale))
  assert np.isnan(out[0]).all() and not np.isfinite(out[1]).all()
  ref = reference_float64(dy[2:], q, scale)
  assert np.isfinite(out[2:]).all() and rel_err(out[2:], ref) <= TOL
