"""Tensor-parallel checks on 8 forced host CPU devices, run by `tests/test_sharding.py`.

The device count must be set before JAX starts, so these run in a fresh
interpreter: `python tests/sharded_checks.py OUT.json [CHECK ...]` writes
`{check: {"status": "ok" | "fail" | "skip", "detail": str}}` to OUT.json.
Every check compares against a float64 product of the dequantised weights
computed in NumPy on the host (the single-device reference).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import q8rules  # noqa: E402
from q8rules import sharding  # noqa: E402
from q8rules.q8_0 import BLOCK, Q8Array  # noqa: E402
from q8rules.sharding.product import shard_map_unchecked  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests._utils import q8_weights as weights  # noqa: E402
from tests._utils import rel_err  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message="Q8 rule matched nothing")

RTOL = 1e-6
"""Relative error (2-norm) allowed against the float64 reference, float32 activations."""


class Skip(Exception):
  """A check that cannot run in this tree (said why)."""


def dequant64(a: Q8Array) -> np.ndarray:
  """The Q8_0 weight (K, N) in float64."""
  q = np.asarray(a.q, np.float64)
  s = np.repeat(np.asarray(a.scale, np.float64), BLOCK, axis=0)
  return q * s


def mesh_of(n: int, names: tuple[str, ...] = ("tp",), axis_type=AxisType.Auto, shape=None):
  shape = shape or (n,)
  return jax.make_mesh(
    shape, names, axis_types=(axis_type,) * len(names), devices=jax.devices()[:n]
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


# ---- the checks -------------------------------------------------------------------


def check_column_parallel(rng: np.random.Generator) -> str:
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
  return f"rel err {err:.1e}; q shards {(k, n // d)}, scale {(k // BLOCK, n // d)}; no collective"


def check_row_parallel(rng: np.random.Generator) -> str:
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
  assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") >= 1, "no all-reduce"
  assert "all-gather" not in hlo, "the row-parallel product gathers something"
  # bfloat16 activations: float32 partial sums are added, then cast once.
  xb = jnp.asarray(x32, jnp.bfloat16)
  yb = jax.jit(f)(xb, w)
  assert yb.dtype == jnp.bfloat16, yb.dtype
  refb = np.asarray(xb, np.float64) @ dequant64(a)
  ulp = np.abs(np.asarray(jnp.asarray(refb, jnp.bfloat16), np.float64)) * 2.0**-7
  worst = float(np.max(np.abs(np.asarray(yb, np.float64) - refb) / np.maximum(ulp, 1e-30)))
  assert worst <= 1.0, f"bf16 output off by {worst:.2f} bf16 ulps (cast before the psum?)"
  return f"rel err {err:.1e}; q shards {(k // d, n)}, scale {(k // BLOCK // d, n)}; bf16 within {worst:.2f} ulp"


def check_megatron_mlp(rng: np.random.Generator) -> str:
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
  reduces = len(re.findall(r"all-reduce(?:-start)?\(", hlo))
  assert reduces == 1, f"{reduces} all-reduces, want 1 (the row-parallel sum)"
  assert "all-gather" not in hlo, "the hidden activation was gathered"
  return f"rel err {err:.1e}; one all-reduce, no all-gather"


def check_data_and_tensor_parallel(rng: np.random.Generator) -> str:
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
  return f"rel err {err:.1e}; output P('dp', 'tp')"


def check_fold_width_40(rng: np.random.Generator) -> str:
  """N=80 over 2 devices: 40 columns per shard, padded per shard to the fold's 128-wide tile."""
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
  text = jax.jit(f).lower(x, w).as_text()
  pads = re.findall(r"stablehlo\.pad .*?: \(tensor<(\w+)>, .*?\) -> tensor<(\w+)>", text)
  assert ("1024x40xi8", "1024x128xi8") in pads, f"no per-shard pad of q 40 -> 128 columns: {pads}"
  assert ("32x40xf32", "32x128xf32") in pads, f"no per-shard pad of the scales: {pads}"
  assert not any(src.startswith("1024x80") for src, _ in pads), f"a global pad: {pads}"
  return f"rel err {err:.1e}; pads {sorted(set(pads))}"


class _MLP:
  """A linen block with every Megatron shape: heads (column by head), out (row by head),
  up (column), down (row)."""

  @staticmethod
  def make():
    import flax.linen as nn

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.DenseGeneral((4, 32), name="heads")(x)  # (64, 4, 32) -> (64, 128)
        h = nn.Einsum((4, 32, 64), "btnh,nhd->btd", name="out")(jax.nn.relu(h))
        h = nn.Dense(256, name="up")(x + h)
        return nn.Dense(64, name="down")(jax.nn.relu(h))

    return Block()


LINEN_SPECS = {
  "heads/kernel": P(None, "tp", None),
  "heads/bias": P("tp", None),
  "out/kernel": P("tp", None, None),
  "up/kernel": P(None, "tp"),
  "up/bias": P("tp"),
  "down/kernel": P("tp", None),
}


_SETUP: dict[str, tuple] = {}


def _linen_setup(rng: np.random.Generator):
  """The quantized block, its input, params (float, abstract Q8, Q8) and its one-device
  output; made once per run (the checks using it read it, never change it)."""
  if "linen" in _SETUP:
    return _SETUP["linen"]
  import qwix

  model = _MLP.make()
  x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
  float_params = jax.jit(model.init)(jax.random.key(1), x)["params"]
  provider = q8rules.Q8Provider([q8rules.Q8Rule(module_path="heads|out|up|down")])
  qmodel = qwix.quantize_model(model, provider)
  abstract = jax.eval_shape(qmodel.init, jax.random.key(1), x)["params"]
  q8_params = jax.jit(lambda fp: q8rules.quantize_params(fp, abstract))(float_params)
  single = np.asarray(jax.jit(qmodel.apply)({"params": q8_params}, x))
  _SETUP["linen"] = qmodel, x, abstract, float_params, q8_params, single
  return _SETUP["linen"]


def _reduces(hlo: str) -> int:
  return len(re.findall(r"all-reduce(?:-start)?\(", hlo))


def check_rules_linen_xla_partitioned(rng: np.random.Generator) -> str:
  """shard_params + jit, no context: XLA partitions the chunked XLA products itself."""
  qmodel, x, abstract, float_params, q8_params, single = _linen_setup(rng)
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
  return f"rel err to one device {err:.1e}"


def check_rules_linen_shard_products(rng: np.random.Generator) -> str:
  """shard_params + jit inside `shard_products`: each matched product runs per shard."""
  qmodel, x, _, _, q8_params, single = _linen_setup(rng)
  details = []
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = mesh_of(4, axis_type=axis_type)
    placed = sharding.shard_params(q8_params, mesh, LINEN_SPECS)
    with q8rules.shard_products(mesh, LINEN_SPECS):
      fn = jax.jit(qmodel.apply)
      y = fn({"params": placed}, x)
      hlo = fn.lower({"params": placed}, x).compile().as_text()
    err = rel_err(y, single)
    assert err <= RTOL, f"{axis_type}: relative error to one device {err:.2e}"
    # Two row-parallel products (out, down): one all-reduce each, nothing gathered.
    assert _reduces(hlo) == 2, f"{axis_type}: {_reduces(hlo)} all-reduces, want 2"
    assert "all-gather" not in hlo, f"{axis_type}: something is gathered"
    details.append(f"{axis_type.name}: rel err {err:.1e}, 2 all-reduces")
  # A function jitted and run outside the context is traced again inside it.
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
  # Explicit sharding without the context: the specs are in the weights' types.
  mesh = mesh_of(4, axis_type=AxisType.Explicit)
  placed = sharding.shard_params(q8_params, mesh, LINEN_SPECS)
  fn = jax.jit(qmodel.apply)
  y = fn({"params": placed}, x)
  hlo = fn.lower({"params": placed}, x).compile().as_text()
  err = rel_err(y, single)
  assert err <= RTOL and _reduces(hlo) == 2, (err, _reduces(hlo))
  details.append(f"Explicit, no context: rel err {err:.1e}")
  return "; ".join(details)


def check_rules_nnx(rng: np.random.Generator) -> str:
  import qwix
  from flax import nnx

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
  fn = nnx.jit(lambda m, x: m(x))
  err = rel_err(fn(qnet, x), single)
  assert err <= RTOL, f"relative error to one device (XLA partitioned) {err:.2e}"
  detail = f"XLA-partitioned rel err {err:.1e}"
  with q8rules.shard_products(mesh, specs):
    y = nnx.jit(lambda m, x: m(x))(qnet, x)
    hlo = jax.jit(lambda s, x: nnx.merge(nnx.graphdef(qnet), s)(x)).lower(nnx.state(qnet), x)
    hlo = hlo.compile().as_text()
  err = rel_err(y, single)
  assert err <= RTOL, f"relative error to one device (shard_products) {err:.2e}"
  assert _reduces(hlo) == 1 and "all-gather" not in hlo, _reduces(hlo)
  detail += f"; shard_products rel err {err:.1e}, 1 all-reduce"
  return detail


def check_qwix_user_shard_map(rng: np.random.Generator) -> str:
  """The Qwix gap: a weight the model itself passes into `jax.shard_map` stays float."""
  import flax.linen as nn
  import qwix

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
  return "the weight inside the model's own shard_map is not found by Qwix: served float"


CHECKS: dict[str, Callable[[np.random.Generator], str]] = {
  "column_parallel": check_column_parallel,
  "row_parallel": check_row_parallel,
  "megatron_mlp": check_megatron_mlp,
  "data_and_tensor_parallel": check_data_and_tensor_parallel,
  "fold_width_40": check_fold_width_40,
  "rules_linen_xla_partitioned": check_rules_linen_xla_partitioned,
  "rules_linen_shard_products": check_rules_linen_shard_products,
  "rules_nnx": check_rules_nnx,
  "qwix_user_shard_map": check_qwix_user_shard_map,
}


def main(argv: list[str]) -> int:
  out_path, names = argv[1], argv[2:] or list(CHECKS)
  assert jax.device_count() == 8, f"{jax.device_count()} devices: XLA_FLAGS was not applied"
  results = {}
  for i, name in enumerate(names):
    t = time.perf_counter()
    try:
      detail = CHECKS[name](np.random.default_rng(1000 + i))
      status = "ok"
    except Skip as e:
      status, detail = "skip", str(e)
    except Exception:  # reported to the test, which fails with it
      status, detail = "fail", traceback.format_exc()
    results[name] = {"status": status, "detail": detail, "seconds": time.perf_counter() - t}
    print(f"{name}: {status} ({results[name]['seconds']:.1f} s) {detail}", flush=True)
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
