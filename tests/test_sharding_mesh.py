"""Tensor-parallel Q8_0 on several devices (`q8rules.sharding`, `q8rules.shard_products`).

On a CPU host tests/conftest.py gives JAX 8 host devices before it starts; on another
backend a test needing more devices than it has is skipped, saying how many it has.
Products are compared with a float64 product of the dequantised weights computed in
NumPy, models with their one-device output (itself checked in tests/test_provider.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import q8rules
from q8rules import kernels, sharding
from q8rules.kernels.matmul import fold
from q8rules.q8_0 import BLOCK, Q8Array
from q8rules.sharding.product import shard_map_unchecked
from tests._utils import matrix, rel_err
from tests._utils import q8_weights as weights

pytestmark = pytest.mark.filterwarnings("ignore:Q8 rule matched nothing")

RTOL = 1e-6
"""Relative error (2-norm) allowed against the float64 reference, float32 activations."""


def dequant64(a: Q8Array) -> np.ndarray:
  """The Q8_0 weight (K, N) in float64."""
  q = np.asarray(a.q, np.float64)
  s = np.repeat(np.asarray(a.scale, np.float64), BLOCK, axis=0)
  return q * s


def mesh_of(
  n: int,
  names: tuple[str, ...] = ("tp",),
  axis_type: AxisType = AxisType.Auto,
  shape: tuple[int, ...] | None = None,
) -> jax.sharding.Mesh:
  """A mesh over the default backend's first `n` devices (skips the test when it has fewer)."""
  devices = jax.devices()
  if len(devices) < n:
    pytest.skip(f"needs {n} devices; the {jax.default_backend()} backend has {len(devices)}")
  return jax.make_mesh(
    shape or (n,), names, axis_types=(axis_type,) * len(names), devices=devices[:n]
  )


def shard_shapes(a: jax.Array) -> set[tuple[int, ...]]:
  return {tuple(s.data.shape) for s in a.addressable_shards}


def check_holds_only_its_shard(a: jax.Array, full: np.ndarray, what: str) -> None:
  """Every device's buffer is exactly its slice of the global array, and no more."""
  for s in a.addressable_shards:
    got = np.asarray(s.data)
    want = full[s.index]
    assert got.shape == want.shape, (
      f"{what}: device {s.device} holds {got.shape}, want {want.shape}"
    )
    assert np.array_equal(got, want), f"{what}: device {s.device} holds other values"


def compiled_text(fn: Callable, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def gathered(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, shape) of what each all-gather of a compiled program produces."""
  found = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
  return [(dt, tuple(int(v) for v in dims.split(",") if v)) for dt, dims in found]


def reduces(hlo: str) -> int:
  """How many all-reduces a compiled program runs."""
  return len(re.findall(r"all-reduce(?:-start)?\(", hlo))


def check_only_partial_sums_move(hlo: str, want: list[tuple[int, ...]]) -> None:
  """The program's only collectives are the row-parallel products' float32 partial sums,
  gathered (shards, m, N_local) to be added in mesh order (`sharding.product.ordered_sum`):
  no all-reduce, and no activation or weight is gathered."""
  assert reduces(hlo) == 0, f"{reduces(hlo)} all-reduces (partial sums go through ordered_sum)"
  assert "all-to-all" not in hlo, "unexpected all-to-all"
  assert sorted(gathered(hlo)) == sorted(("f32", shape) for shape in want), gathered(hlo)


# ---- q8_matmul_sharded -------------------------------------------------------------


def test_column_parallel(rng):
  k, n, d = 512, 256, 8
  mesh = mesh_of(d)
  a = weights(rng, k, n)
  w = sharding.shard_q8(a, mesh, P(None, "tp"))
  assert shard_shapes(w.q) == {(k, n // d)}, shard_shapes(w.q)
  assert shard_shapes(w.scale) == {(k // BLOCK, n // d)}, shard_shapes(w.scale)
  check_holds_only_its_shard(w.q, np.asarray(a.q), "q")
  check_holds_only_its_shard(w.scale, np.asarray(a.scale), "scale")
  x = jax.device_put(rng.standard_normal((3, 5, k)).astype(np.float32), NamedSharding(mesh, P()))

  def f(x, w):
    return sharding.q8_matmul_sharded(x, w, mesh, w_spec=P(None, "tp"))

  y = jax.jit(f)(x, w)
  err = rel_err(y, np.asarray(x, np.float64) @ dequant64(a))
  assert err <= RTOL, f"relative error {err:.2e}"
  assert y.sharding.spec == P(None, None, "tp"), y.sharding.spec
  assert shard_shapes(y) == {(3, 5, n // d)}
  hlo = compiled_text(f, x, w)
  assert "all-gather" not in hlo, "the column-parallel product gathers something"
  assert "all-reduce" not in hlo and "all-to-all" not in hlo, "unexpected collective"


def test_row_parallel(rng):
  k, n, d = 512, 256, 8
  mesh = mesh_of(d, axis_type=AxisType.Explicit)  # jax.make_mesh's default in jax 0.10
  a = weights(rng, k, n, scale_dtype=jnp.float16)
  w = sharding.shard_q8(a, mesh, P("tp", None))
  assert shard_shapes(w.q) == {(k // d, n)}, shard_shapes(w.q)
  assert shard_shapes(w.scale) == {(k // BLOCK // d, n)}, shard_shapes(w.scale)
  check_holds_only_its_shard(w.q, np.asarray(a.q), "q")
  check_holds_only_its_shard(w.scale, np.asarray(a.scale), "scale")
  x32 = rng.standard_normal((4, k)).astype(np.float32)
  ref = x32.astype(np.float64) @ dequant64(a)

  def f(x, w):
    return sharding.q8_matmul_sharded(x, w, mesh, w_spec=P("tp", None))

  x = jax.device_put(x32, NamedSharding(mesh, P(None, "tp")))
  y = jax.jit(f)(x, w)
  err = rel_err(y, ref)
  assert err <= RTOL, f"relative error {err:.2e}"
  assert tuple(y.sharding.spec) in ((), (None, None)), y.sharding.spec
  hlo = compiled_text(f, x, w)
  check_only_partial_sums_move(hlo, [(d, 4, n)])
  # bfloat16 activations: float32 partial sums are added, then cast once.
  xb = jnp.asarray(x32, jnp.bfloat16)
  yb = jax.jit(f)(xb, w)
  assert yb.dtype == jnp.bfloat16, yb.dtype
  refb = np.asarray(xb, np.float64) @ dequant64(a)
  ulp = np.abs(np.asarray(jnp.asarray(refb, jnp.bfloat16), np.float64)) * 2.0**-7
  worst = float(np.max(np.abs(np.asarray(yb, np.float64) - refb) / np.maximum(ulp, 1e-30)))
  assert worst <= 1.0, f"bf16 output off by {worst:.2f} bf16 ulps (cast before the psum?)"


@pytest.mark.slow
def test_megatron_mlp(rng):
  d_model, d_ff, d = 256, 1024, 8
  mesh = mesh_of(d)
  a1, a2 = weights(rng, d_model, d_ff), weights(rng, d_ff, d_model)
  w1 = sharding.shard_q8(a1, mesh, P(None, "tp"))
  w2 = sharding.shard_q8(a2, mesh, P("tp", None))
  x = rng.standard_normal((4, d_model)).astype(np.float32)

  def mlp(x, w1, w2):
    h = jax.nn.relu(sharding.q8_matmul_sharded(x, w1, mesh, w_spec=P(None, "tp")))
    return sharding.q8_matmul_sharded(h, w2, mesh, w_spec=P("tp", None))

  y = jax.jit(mlp)(x, w1, w2)
  ref = np.maximum(x.astype(np.float64) @ dequant64(a1), 0) @ dequant64(a2)
  err = rel_err(y, ref)
  assert err <= RTOL, f"relative error {err:.2e}"
  hlo = compiled_text(mlp, x, w1, w2)
  check_only_partial_sums_move(hlo, [(d, 4, d_model)])  # the hidden activation stays split


def test_data_and_tensor_parallel(rng):
  k, n = 256, 512
  mesh = mesh_of(8, ("dp", "tp"), shape=(2, 4))
  a = weights(rng, k, n)
  w = sharding.shard_q8(a, mesh, P(None, "tp"))
  x = jax.device_put(rng.standard_normal((6, k)).astype(np.float32), NamedSharding(mesh, P("dp")))
  y = jax.jit(
    lambda x, w: sharding.q8_matmul_sharded(x, w, mesh, w_spec=P(None, "tp"), x_spec=P("dp", None))
  )(x, w)
  err = rel_err(y, np.asarray(x, np.float64) @ dequant64(a))
  assert err <= RTOL, f"relative error {err:.2e}"
  assert y.sharding.spec == P("dp", "tp"), y.sharding.spec
  assert shard_shapes(y) == {(3, n // 4)}, shard_shapes(y)


def test_fold_pads_each_shard_not_the_whole_weight(rng):
  """N=80 over 2 devices: 40 columns per shard, padded per shard to the fold's column tile."""
  k, n, d = 1024, 80, 2
  mesh = mesh_of(d)
  a = weights(rng, k, n)
  w = sharding.shard_q8(a, mesh, P(None, "tp"))
  x = rng.standard_normal((1, k)).astype(np.float32)

  def f(x, w):
    return sharding.q8_matmul_sharded(x, w, mesh, w_spec=P(None, "tp"), implementation="fold")

  y = jax.jit(f)(x, w)
  err = rel_err(y, x.astype(np.float64) @ dequant64(a))
  assert err <= RTOL, f"relative error {err:.2e}"
  assert y.shape == (1, n) and y.sharding.spec == P(None, "tp"), (y.shape, y.sharding.spec)
  wide = fold.padded_columns(n // d, fold.kernel_form())  # the form's column tile (CPU: TPU's)
  text = jax.jit(f).lower(x, w).as_text()
  pads = re.findall(r"stablehlo\.pad .*?: \(tensor<(\w+)>, .*?\) -> tensor<(\w+)>", text)
  assert (f"{k}x40xi8", f"{k}x{wide}xi8") in pads, f"no per-shard pad of q 40 -> {wide}: {pads}"
  assert (f"{k // BLOCK}x40xf32", f"{k // BLOCK}x{wide}xf32") in pads, f"no scale pad: {pads}"
  assert not any(src.startswith(f"{k}x{n}") for src, _ in pads), f"a global pad: {pads}"


# ---- models under Q8Provider -------------------------------------------------------


class Block(nn.Module):
  """Every Megatron shape: heads (column by head), out (row by head), up (column), down (row)."""

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((4, 32), name="heads")(x)  # (64, 4, 32) -> (64, 128)
    h = nn.Einsum((4, 32, 64), "btnh,nhd->btd", name="out")(jax.nn.relu(h))
    h = nn.Dense(256, name="up")(x + h)
    return nn.Dense(64, name="down")(jax.nn.relu(h))


LINEN_SPECS = {
  "heads/kernel": P(None, "tp", None),
  "heads/bias": P("tp", None),
  "out/kernel": P("tp", None, None),
  "up/kernel": P(None, "tp"),
  "up/bias": P("tp"),
  "down/kernel": P("tp", None),
}


@pytest.fixture(scope="module")
def linen_block():
  """The quantized block, its provider, input, params (abstract Q8, float, Q8) and its one-device
  output (the tests read them, never change them)."""
  rng = np.random.default_rng(2024)
  x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
  float_params = jax.jit(Block().init)(jax.random.key(1), x)["params"]
  provider = q8rules.Q8Provider([q8rules.Q8Rule(module_path="heads|out|up|down")])
  qmodel = qwix.quantize_model(Block(), provider)
  abstract = jax.eval_shape(qmodel.init, jax.random.key(1), x)["params"]
  q8_params = jax.jit(lambda fp: q8rules.quantize_params(fp, abstract))(float_params)
  single = np.asarray(jax.jit(qmodel.apply)({"params": q8_params}, x))
  return qmodel, provider, x, abstract, float_params, q8_params, single


def apply_and_compile(qmodel, params, x) -> tuple[jax.Array, str]:
  """The linen model's output under jit, and the compiled program's text."""
  fn = jax.jit(qmodel.apply)
  return fn({"params": params}, x), fn.lower({"params": params}, x).compile().as_text()


@pytest.mark.slow
def test_linen_params_on_a_mesh_xla_partitioned(linen_block):
  """shard_params + jit, no context: XLA partitions the chunked XLA products itself."""
  qmodel, _, x, abstract, float_params, q8_params, single = linen_block
  mesh = mesh_of(4)
  placed = sharding.shard_params(q8_params, mesh, LINEN_SPECS)
  heads = placed["heads"]["kernel"].array
  assert shard_shapes(heads.q) == {(64, 32)}, shard_shapes(heads.q)  # (D, heads*H) by heads
  assert shard_shapes(heads.scale) == {(2, 32)}, shard_shapes(heads.scale)
  out = placed["out"]["kernel"].array
  assert shard_shapes(out.q) == {(32, 64)} and shard_shapes(out.scale) == {(1, 64)}
  down = placed["down"]["kernel"].array
  assert shard_shapes(down.q) == {(64, 64)} and shard_shapes(down.scale) == {(2, 64)}
  check_holds_only_its_shard(down.q, np.asarray(q8_params["down"]["kernel"].array.q), "down q")
  assert shard_shapes(placed["up"]["bias"]) == {(64,)}
  y = jax.jit(qmodel.apply)({"params": placed}, x)
  err = rel_err(y, single)
  assert err <= RTOL, f"relative error to one device {err:.2e}"
  # Quantizing straight onto the mesh: jit with the param shardings as out_shardings.
  shardings = sharding.param_shardings(abstract, mesh, LINEN_SPECS)
  direct = jax.jit(lambda fp: q8rules.quantize_params(fp, abstract), out_shardings=shardings)(
    float_params
  )
  got = direct["down"]["kernel"].array.q
  assert got.sharding.spec == P("tp", None) and shard_shapes(got) == {(64, 64)}
  assert np.array_equal(np.asarray(got), np.asarray(q8_params["down"]["kernel"].array.q))


@pytest.mark.parametrize(
  "axis_type", matrix([AxisType.Auto, AxisType.Explicit], AxisType.Explicit), ids=lambda t: t.name
)
def test_linen_shard_products_runs_each_product_per_shard(linen_block, axis_type):
  qmodel, provider, x, _, _, q8_params, single = linen_block
  mesh = mesh_of(4, axis_type=axis_type)
  placed = sharding.shard_params(q8_params, mesh, LINEN_SPECS)
  with q8rules.shard_products(mesh, LINEN_SPECS):
    y, hlo = apply_and_compile(qmodel, placed, x)
  err = rel_err(y, single)
  assert err <= RTOL, f"relative error to one device {err:.2e}"
  # Two row-parallel products (out, down): their (4 shards, 6 rows, 64) partial sums move.
  check_only_partial_sums_move(hlo, [(4, 6, 64), (4, 6, 64)])
  # The report names what the shards ran: the choice for a shard's own (m, K, N).
  local = {"heads": (64, 32), "out": (32, 64), "up": (64, 64), "down": (64, 64)}
  for r in provider.report().ops:
    want = kernels.resolve_product(6, *local[r.module], jnp.float32)
    assert r.path == want, (r.module, r.path, want)


def test_shard_products_retraces_a_function_jitted_outside_it(linen_block):
  qmodel, _, x, _, _, q8_params, single = linen_block
  mesh = mesh_of(4)
  placed = sharding.shard_params(q8_params, mesh, LINEN_SPECS)
  traces = []

  def apply(variables, x):
    traces.append(1)
    return qmodel.apply(variables, x)

  fn = jax.jit(apply)
  fn({"params": placed}, x)
  with q8rules.shard_products(mesh, LINEN_SPECS):
    err = rel_err(fn({"params": placed}, x), single)
  assert len(traces) == 2, f"{len(traces)} traces: the context did not re-trace"
  assert err <= RTOL, err


def test_explicit_sharding_splits_products_without_the_context(linen_block):
  """Without `shard_products`, the specs in the weights' types (explicit axes) split them."""
  qmodel, _, x, _, _, q8_params, single = linen_block
  mesh = mesh_of(4, axis_type=AxisType.Explicit)
  placed = sharding.shard_params(q8_params, mesh, LINEN_SPECS)
  y, hlo = apply_and_compile(qmodel, placed, x)
  err = rel_err(y, single)
  assert err <= RTOL, f"relative error to one device {err:.2e}"
  check_only_partial_sums_move(hlo, [(4, 6, 64), (4, 6, 64)])  # out and down


def test_data_parallel_rows_pick_the_shards_implementation(rng):
  """`batch=` splits the activation rows too: each shard runs (and the report names) the
  implementation for its own rows."""
  m, k, n = 24, 64, 128
  mesh = mesh_of(4, ("dp", "tp"), shape=(2, 2))
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  qmodel = qwix.quantize_model(nn.Dense(n, use_bias=False), provider)
  params = jax.jit(qmodel.init)(jax.random.key(0), x)["params"]
  specs = {"kernel": P(None, "tp")}
  placed = sharding.shard_params(params, mesh, specs)
  with q8rules.shard_products(mesh, specs, batch="dp"):
    y = jax.jit(qmodel.apply)({"params": placed}, x)
  assert y.sharding.spec == P("dp", "tp"), y.sharding.spec
  ref = np.asarray(x, np.float64) @ dequant64(params["kernel"].array)
  err = rel_err(y, ref)
  assert err <= RTOL, f"relative error {err:.2e}"
  [record] = provider.report().ops
  assert record.path == kernels.resolve_product(m // 2, k, n // 2, jnp.float32), record


def test_nnx_params_on_a_mesh(rng):
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(64, 256, rngs=rngs)
      self.down = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
  qnet = qwix.quantize_model(Net(nnx.Rngs(0)), q8rules.Q8Provider([q8rules.Q8Rule()]), x)
  single = np.asarray(qnet(x))
  specs = {"up/kernel": P(None, "tp"), "up/bias": P("tp"), "down/kernel": P("tp", None)}
  mesh = mesh_of(4)
  sharding.shard_params(qnet, mesh, specs)
  assert shard_shapes(qnet.up.kernel.array.q.get_value()) == {(64, 64)}
  assert shard_shapes(qnet.down.kernel.array.scale.get_value()) == {(2, 64)}
  err = rel_err(nnx.jit(lambda m, x: m(x))(qnet, x), single)
  assert err <= RTOL, f"relative error to one device (XLA partitioned) {err:.2e}"
  with q8rules.shard_products(mesh, specs):
    y = nnx.jit(lambda m, x: m(x))(qnet, x)
    hlo = jax.jit(lambda s, x: nnx.merge(nnx.graphdef(qnet), s)(x)).lower(nnx.state(qnet), x)
    hlo = hlo.compile().as_text()
  err = rel_err(y, single)
  assert err <= RTOL, f"relative error to one device (shard_products) {err:.2e}"
  check_only_partial_sums_move(hlo, [(4, 6, 64)])  # down's partial sums


@pytest.mark.slow
def test_nnx_model_made_under_an_explicit_mesh_quantizes(rng):
  """A float nnx model built under `jax.set_mesh` with Explicit axes (its kernels split by
  `nnx.with_partitioning`) is quantized by `qwix.quantize_model` as it stands: each Q8_0
  array takes its kernel's split along N, and the output (eager and jitted) matches a
  float64 pass through the dequantised weights."""
  mesh = mesh_of(4, axis_type=AxisType.Explicit)
  split_n = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp"))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(64, 256, use_bias=False, kernel_init=split_n, rngs=rngs)
      self.down = nnx.Linear(256, 128, use_bias=False, kernel_init=split_n, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.sharding.reshard(jax.nn.relu(self.up(x)), P()))

  x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
  with jax.set_mesh(mesh):
    qnet = qwix.quantize_model(Net(nnx.Rngs(0)), q8rules.Q8Provider([q8rules.Q8Rule()]), x)
    outs = [qnet(x), nnx.jit(lambda m, x: m(x))(qnet, x)]
  weights = {}
  for name in ("up", "down"):
    array = getattr(qnet, name).kernel.array
    for part in (array.q.get_value(), array.scale.get_value()):
      assert part.sharding.spec == P(None, "tp"), (name, part.sharding.spec)
    weights[name] = dequant64(Q8Array(array.q.get_value(), array.scale.get_value()))
  h = np.maximum(np.asarray(x, np.float64) @ weights["up"], 0)
  ref = h @ weights["down"]
  for y in outs:
    err = rel_err(y, ref)
    assert err <= RTOL, f"relative error to float64 {err:.2e}"


def test_a_weight_inside_the_models_own_shard_map_stays_float(rng):
  """The Qwix gap: a weight the model itself passes into `jax.shard_map` is not found."""
  mesh = mesh_of(2)

  class TPDense(nn.Module):
    @nn.compact
    def __call__(self, x):
      kernel = self.param("kernel", nn.initializers.lecun_normal(), (64, 128))
      body = shard_map_unchecked(
        lambda x, k: jnp.dot(x, k), mesh, in_specs=(P(), P(None, "tp")), out_specs=P(None, "tp")
      )
      return body(x, kernel)

  x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  qmodel = qwix.quantize_model(TPDense(), provider)
  params = qmodel.init(jax.random.key(0), x)["params"]
  kernel = params["kernel"]
  rows = provider.report().ops
  assert isinstance(kernel, jax.Array) and kernel.dtype == jnp.float32, type(kernel)
  assert [(r.path, r.note) for r in rows] == [("float", "operand is not a weight")], rows
