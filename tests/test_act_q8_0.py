"""The opt-in Q8_0 x Q8_0 product (`act_qtype='q8_0'`): activations quantized as gguf.quants
quantizes them, bit for bit, and the product against a float64 reference built from those
Q8_0 activations (exact integer block dots, scaled in float64), on every implementation and
path (the native kernel's int8 dots on every SIMD path this CPU runs, XLA); through Q8Rule, Qwix's
`quantize_model`, QAT and `load_gguf`."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import linen as nn

import q8rules
from q8rules.kernels import q8_matmul, resolve_product, run_product
from q8rules.kernels.layer import LayerSlice
from q8rules.kernels.matmul_act_q8 import api as act_q8_0
from q8rules.kernels.matmul_act_q8 import cpu as act_cpu
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd
from q8rules.q8_0 import Q8Array
from tests._utils import matrix, random_q8, random_x, rel_err, weight64

TINY_GGUF = Path(__file__).parent / "data" / "gguf_models" / "tiny-llama-q8_0.gguf"

NATIVE = native_lib.available()
needs_native = pytest.mark.skipif(
  not NATIVE, reason=f"native kernel: {native_lib.unavailable_reason()}"
)


def gguf_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """gguf-py's own Q8_0 of the rows of x (m, K): int8 values and the float16 scales widened."""
  m, k = x.shape
  raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(m, k // 32, 34)
  d = raw[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(m, k // 32)
  return raw[:, :, 2:].copy().view(np.int8).reshape(m, k), d


def hard_activations(rng: np.random.Generator) -> np.ndarray:
  """Rows with the quantizer's hard cases: zero blocks, ties (x * (1/d) exactly k + 1/2), a
  block whose absmax is negative, tiny and huge magnitudes, negative zeros."""
  x = (rng.standard_normal((6, 256)) * 10.0 ** rng.uniform(-3, 3, (6, 1))).astype(np.float32)
  x[0, :32] = 0.0
  x[0, 32:64] = -0.0
  x[1, :32] = np.arange(-16, 16, dtype=np.float32) + 0.5  # amax 16: ties at 127/16 steps
  x[1, 0] = 127.0
  x[1, 1:32] = np.arange(31, dtype=np.float32) + 0.5  # d = 1: every value a tie
  x[2, :32] = -np.abs(x[2, :32])
  x[3, :32] *= np.float32(1e-30)
  x[4, 64:96] *= np.float32(1e30)
  return x


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # gguf: the 1e30 block
def test_quantize_activations_is_gguf_bit_for_bit(rng):
  x = hard_activations(rng)
  ref_q, ref_d = gguf_q8_0(x)
  q, d = (np.asarray(a) for a in act_q8_0.quantize_activations(jnp.asarray(x)))
  np.testing.assert_array_equal(q, ref_q)
  np.testing.assert_array_equal(d.view(np.uint32), ref_d.view(np.uint32))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_kernel_quantizes_as_gguf_bit_for_bit(rng, cpu_isa):
  """The native kernel's own quantizer, on each path's form of it."""
  x = hard_activations(rng)
  ref_q, ref_d = gguf_q8_0(x)
  q, d, corr = act_cpu.quantize_activations_native(x, isa=cpu_isa)
  np.testing.assert_array_equal(q, ref_q)
  np.testing.assert_array_equal(d.view(np.uint32), ref_d.view(np.uint32))
  np.testing.assert_array_equal(corr, -128 * q.reshape(6, -1, 32).astype(np.int32).sum(-1))


# (m, K, N, scale dtype): one row (the streamed path), tile remainders (3, 5), a tile's 4 and 8
# rows, more than one row group of 16; N below, at and past a 64-column stretch; float32 and
# float16 (GGUF's) scales in turn.
CASES = [
  (1, 32, 64, np.float16),
  (1, 2048, 192, np.float32),
  (3, 96, 40, np.float16),
  (4, 256, 128, np.float32),
  (5, 128, 200, np.float16),
  (8, 1024, 130, np.float32),
  (17, 64, 64, np.float16),
  (1, 64, 7, np.float32),
]


def expected_act_path(isa: str) -> str:
  """The int8 path the kernel runs on `isa`: the ISA's own, AVX-512's being VNNI where this
  CPU has it (/proc/cpuinfo's avx512_vnni) and AVX2's dots where not."""
  if isa != "avx512":
    return isa
  return "avx512_vnni" if "avx512_vnni" in native_simd.cpu_flags() else "avx2"


def check_product(rng, name, m, k, n, scale_dtype):
  q, scale = random_q8(rng, k, n, scale_dtype)
  x = random_x(rng, (m, k))
  y = jax.jit(lambda x: q8_matmul(x, Q8Array(q, scale), implementation=name, act_qtype="q8_0"))(x)
  assert y.shape == (m, n) and y.dtype == jnp.float32
  ref = act_q8_0.reference_float64(np.asarray(x), np.asarray(q), np.asarray(scale))
  assert rel_err(y, ref) <= 1e-6, rel_err(y, ref)
  # against the weight-only float64 product: the activations' rounding, well under 1 %
  assert rel_err(y, np.asarray(x, np.float64) @ weight64(q, scale)) < 1e-2
  return y


@pytest.mark.parametrize("m,k,n,scale_dtype", matrix(CASES, *CASES[::3]))
def test_product_matches_float64_of_the_q8_0_activations(rng, m, k, n, scale_dtype):
  check_product(rng, "xla", m, k, n, scale_dtype)


@pytest.mark.parametrize("m,k,n,scale_dtype", CASES)
def test_native_product_matches_float64_on_every_path(rng, cpu_isa, m, k, n, scale_dtype):
  """The native int8 product on each SIMD path this CPU runs (`cpu_isa`), which it reports."""
  check_product(rng, "cpu", m, k, n, scale_dtype)
  assert native_simd.last_act_path() == expected_act_path(cpu_isa)


@needs_native
@pytest.mark.parametrize("m,k,n", [(1, 2048, 192), (2, 256, 130), (5, 128, 200), (17, 64, 70)])
def test_every_path_gives_the_same_bits(rng, monkeypatch, m, k, n):
  """Every path computes the same integer block dots and the same float32 folds in the same
  order: the same bits as the scalar path, one row (streamed) or several (tiles), with and
  without the scalar tail past the last 64-column stretch."""
  q, scale = random_q8(rng, k, n, np.float16)
  x = random_x(rng, (m, k))
  outs = {}
  for isa in native_simd.supported():
    monkeypatch.setenv("Q8RULES_CPU_ISA", isa)
    outs[isa] = np.asarray(act_cpu.q8_matmul_cpu_act_q8(x, q, scale))
    assert native_simd.last_act_path() == expected_act_path(isa)
  for isa, y in outs.items():
    np.testing.assert_array_equal(y, outs["scalar"], err_msg=isa)


def test_default_implementation_per_backend(rng):
  """What `implementation=None` runs, from the dispatcher's own rules: the native kernel's int8
  product on the CPU, else XLA (GPU and TPU: XLA)."""
  backend = jax.default_backend()
  want = "cpu" if backend == "cpu" and native_lib.available() else "xla"
  assert resolve_product(1, 4096, 4096, jnp.float32, act_qtype="q8_0") == want
  assert resolve_product(1, 4096, 4096, backend="tpu", act_qtype="q8_0") == "xla"
  q, scale = random_q8(rng, 64, 32)
  _, ran = run_product(random_x(rng, (2, 64)), Q8Array(q, scale), act_qtype="q8_0")
  assert ran == f"{want} (act q8_0)"


@needs_native
def test_stacked_layer_is_read_in_place_with_q8_0_activations(rng):
  parts = [random_q8(rng, 256, 96, np.float16) for _ in range(3)]
  w = Q8Array(jnp.stack([q for q, _ in parts]), jnp.stack([s for _, s in parts]))
  x = random_x(rng, (2, 256))
  run = jax.jit(lambda x, i: q8_matmul(x, LayerSlice(w, i), act_qtype="q8_0", implementation="cpu"))
  hlo = run.lower(x, jnp.int32(1)).compile().as_text()
  assert native_lib.TARGET_ACT_Q8_LAYER in hlo
  for i, (q, s) in enumerate(parts):
    ref = act_q8_0.reference_float64(np.asarray(x), np.asarray(q), np.asarray(s))
    assert rel_err(run(x, jnp.int32(i)), ref) <= 1e-6


@pytest.mark.parametrize("name", ["xla", *(["cpu"] if NATIVE else [])])
def test_derivatives_are_straight_through(rng, name):
  """d/dx and d/dscale are the weight-only product's: straight through the activations'
  rounding (the float64 derivatives of x @ W)."""
  m, k, n = 2, 128, 48
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  cot = rng.standard_normal((m, n))
  dx = jax.grad(
    lambda x: jnp.sum(q8_matmul(x, Q8Array(q, scale), implementation=name, act_qtype="q8_0") * cot)
  )(x)
  w64 = weight64(q, scale)
  np.testing.assert_allclose(dx, cot @ w64.T, rtol=1e-5, atol=1e-5 * np.abs(cot @ w64.T).max())


def test_bad_options_are_refused_naming_why():
  with pytest.raises(
    ValueError, match=r"^Q8Rule cannot honour act_qtype='int8' \(None, weight-only"
  ):
    q8rules.Q8Rule(act_qtype="int8")
  with pytest.raises(ValueError, match=r"runs on 'cpu' or 'xla', not on 'fold'"):
    q8rules.Q8Rule(act_qtype="q8_0", implementation=("fold", "xla"))
  with pytest.raises(ValueError, match="act_static_scale"):
    q8rules.Q8Rule(act_qtype="q8_0", act_static_scale=True)
  with pytest.raises(
    ValueError, match=r"'fold': expected None, one of \('cpu', 'xla'\) \(op 'matmul_act_q8'"
  ):
    resolve_product(1, 64, 64, implementation="fold", act_qtype="q8_0")
  with pytest.raises(ValueError, match="act_qtype='int4'"):
    resolve_product(1, 64, 64, act_qtype="int4")


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(96, name="up")(x))
    return nn.Dense(40, name="down")(h)


@pytest.mark.slow
def test_quantize_model_runs_the_q8_0_product_and_reports_it(rng):
  """An unmodified linen model through `qwix.quantize_model` with an act_qtype rule: each
  matched product is the Q8_0 x Q8_0 product of the layer's own Q8_0 weight."""
  model = Mlp()
  x = random_x(rng, (3, 64))
  params = model.init(jax.random.key(0), x)["params"]
  provider = q8rules.Q8Provider([q8rules.Q8Rule(module_path=".*", act_qtype="q8_0")])
  qmodel = qwix.quantize_model(model, provider)
  served = q8rules.quantize_params(
    params, jax.eval_shape(qmodel.init, jax.random.key(0), x)["params"]
  )
  y = qmodel.apply({"params": served}, x)
  paths = provider.report().paths()
  want = resolve_product(3, 64, 96, jnp.float32, act_qtype="q8_0")
  assert set(paths.values()) == {f"{want} (act q8_0)"}, paths
  up, down = served["up"]["kernel"].array, served["down"]["kernel"].array
  h = act_q8_0.reference_float64(np.asarray(x), np.asarray(up.q), np.asarray(up.scale))
  h = np.asarray(nn.gelu(jnp.asarray(h + np.asarray(params["up"]["bias"]), jnp.float32)))
  ref = act_q8_0.reference_float64(h, np.asarray(down.q), np.asarray(down.scale))
  ref = ref + np.asarray(params["down"]["bias"])
  assert rel_err(y, ref) <= 1e-5


@pytest.mark.slow
def test_qat_forward_is_the_served_q8_0_product(rng):
  """QAT with an act_qtype rule: the forward is the served Q8_0 x Q8_0 product, the gradient
  straight through both roundings (finite, and the float model's at the fake-quant weights
  within the activations' rounding)."""
  model = Mlp()
  x = random_x(rng, (3, 64))
  params = model.init(jax.random.key(0), x)["params"]
  rule = q8rules.Q8Rule(module_path=".*", act_qtype="q8_0")
  qat = qwix.quantize_model(model, q8rules.Q8QatProvider([rule]))
  provider = q8rules.Q8Provider([rule])
  served_model = qwix.quantize_model(model, provider)
  abstract = jax.eval_shape(served_model.init, jax.random.key(0), x)["params"]
  served = q8rules.quantize_params(params, abstract)
  np.testing.assert_array_equal(
    qat.apply({"params": params}, x), served_model.apply({"params": served}, x)
  )
  grads = jax.grad(lambda p: jnp.sum(qat.apply({"params": p}, x) ** 2))(params)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_load_gguf_with_q8_0_activations():
  """The tiny llama file with `act_qtype='q8_0'`: every Q8_0 product quantizes its
  activations (the rule says so) and the logits stay within the activations' rounding of the
  weight-only model's."""
  plain = q8rules.load_gguf(TINY_GGUF, dtype=jnp.float32, progress=False)
  act = q8rules.load_gguf(TINY_GGUF, dtype=jnp.float32, progress=False, act_qtype="q8_0")
  ids = [1, 5, 9, 3]
  a, b = np.asarray(plain.logits(ids)), np.asarray(act.logits(ids))
  assert 0 < rel_err(b, a) < 5e-2


@pytest.mark.slow
def test_export_carries_each_platforms_q8_0_product(rng):
  """One `jax.export` for ('cpu', 'cuda', 'tpu') of an act_qtype product: the CPU module calls
  the native kernel's Q8_0-activation target where the dispatcher picks it, the others run
  XLA's int8 dots; the artifact runs here and matches the float64 reference."""
  from jax import export

  from q8rules.kernels import export_checks, lowering_context

  q, scale = random_q8(rng, 256, 64, np.float16)
  x = random_x(rng, (2, 256))
  f = jax.jit(lambda x, q, s: q8_matmul(x, Q8Array(q, s), act_qtype="q8_0"))
  with lowering_context(("cpu", "cuda", "tpu")):
    exp = export.export(f, platforms=("cpu", "cuda", "tpu"), disabled_checks=export_checks())(
      x, q, scale
    )
  on_cpu = resolve_product(2, 256, 64, jnp.float32, "cpu", act_qtype="q8_0") == "cpu"
  text = exp.mlir_module()
  assert (native_lib.TARGET_ACT_Q8 in text) == on_cpu
  assert f"@{native_lib.TARGET}(" not in text
  ref = act_q8_0.reference_float64(np.asarray(x), np.asarray(q), np.asarray(scale))
  assert rel_err(exp.call(x, q, scale), ref) <= 1e-6


@pytest.mark.parametrize("w_spec", ["column", "row"])
def test_sharded_product_quantizes_the_unsharded_blocks(rng, w_spec):
  """Split over 4 devices, column- or row-parallel: each shard quantizes its own K slice (whole
  32-blocks), so the product is the unsharded Q8_0 x Q8_0 product's, to float32 rounding."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from q8rules import sharding

  devices = jax.devices()
  if len(devices) < 4:
    pytest.skip(f"needs 4 devices; the {jax.default_backend()} backend has {len(devices)}")
  mesh = jax.make_mesh((4,), ("tp",), devices=devices[:4])
  spec = P(None, "tp") if w_spec == "column" else P("tp", None)
  q, scale = random_q8(rng, 512, 128, np.float16)
  w = sharding.shard_q8(Q8Array(q, scale), mesh, spec)
  x = random_x(rng, (3, 512))
  x = jax.device_put(x, NamedSharding(mesh, P(None, "tp") if w_spec == "row" else P()))
  y = jax.jit(lambda x, w: sharding.q8_matmul_sharded(x, w, mesh, w_spec=spec, act_qtype="q8_0"))(
    x, w
  )
  ref = act_q8_0.reference_float64(np.asarray(x), np.asarray(q), np.asarray(scale))
  assert rel_err(y, ref) <= 1e-6
