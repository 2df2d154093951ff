"""The fold kernels lower, on this CPU host, for TPU (Mosaic) and CUDA (Triton).

Each test lowers `q8_fold` for a platform this host does not have, finds the
kernel's custom call in the StableHLO module, and reads the kernel inside it:
the Mosaic module (deserialised from the call's backend config) or the Triton
IR. What Mosaic and Triton do next (layouts, register allocation) runs only on
the chip's own compiler and is not checked here.
"""

from __future__ import annotations

import base64
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir
from jax._src.lib import tpu as tpu_dialect
from jax._src.lib.mlir import ir
from jaxlib.mlir.passmanager import PassManager
from jaxlib.triton import dialect as triton_dialect

from q8rules.kernels.matmul._pallas_compat import MOSAIC_CUSTOM_CALL, TRITON_CUSTOM_CALL
from q8rules.kernels.matmul.fold import q8_fold
from q8rules.q8_0 import BLOCK
from tests._utils import lowering_for


def operand_specs(m: int, k: int, n: int, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
  return (
    jax.ShapeDtypeStruct((m, k), dtype),
    jax.ShapeDtypeStruct((k, n), jnp.int8),
    jax.ShapeDtypeStruct((k // BLOCK, n), jnp.float32),
  )


def lower(backend: str, platform: str, specs) -> ir.Module:
  """StableHLO of the fold lowered for `platform` (not this host's)."""

  def f(x, q, s):
    return q8_fold(x, q, s, backend=backend, interpret=False)

  with lowering_for((platform,)):
    lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=(platform,))
  return lowered.compiler_ir("stablehlo")


def custom_calls(module: ir.Module) -> list[ir.Operation]:
  found = []

  def walk(op):
    if op.operation.name == "stablehlo.custom_call":
      found.append(op.operation)
    for region in op.regions:
      for block in region:
        for inner in block:
          walk(inner)

  walk(module.operation)
  return found


def target(call: ir.Operation) -> str:
  return ir.StringAttr(call.attributes["call_target_name"]).value


def mosaic_text(call: ir.Operation) -> str:
  """The Mosaic kernel a tpu_custom_call carries, as MLIR text."""
  config = json.loads(ir.StringAttr(call.attributes["backend_config"]).value)
  body = base64.b64decode(config["custom_call_config"]["body"])
  ctx = mlir.make_ir_context()
  tpu_dialect.register_dialect(ctx)
  with ctx, ir.Location.unknown():
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(body)
    PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
    return str(module)


def triton_config(call: ir.Operation) -> tuple[dict[str, str], str]:
  """A Triton custom call's launch attributes and its kernel's Triton IR text."""
  config = ir.DictAttr(call.attributes["mhlo.backend_config"])
  attrs = {config[i].name: str(config[i].attr) for i in range(len(config))}
  ir_bytes = ir.StringAttr(config["ir"]).value_bytes
  ctx = mlir.make_ir_context()
  triton_dialect.register_dialect(ctx)
  with ctx, ir.Location.unknown():
    return attrs, str(ir.Module.parse(ir_bytes))


@pytest.mark.parametrize("m,dtype", [(1, jnp.bfloat16), (8, jnp.bfloat16), (8, jnp.float32)])
def test_tpu_form_lowers_to_mosaic(m, dtype):
  (call,) = custom_calls(lower("tpu", "tpu", operand_specs(m, 4096, 40, dtype)))
  assert target(call) == MOSAIC_CUSTOM_CALL
  kernel = mosaic_text(call)
  assert "func.func @q8_fold_tpu" in kernel
  assert (
    "dimension_semantics = [#tpu.dimension_semantics<parallel>,"
    " #tpu.dimension_semantics<arbitrary>]" in kernel
  )
  assert "iteration_bounds = array<i64: 1, 4>" in kernel  # one 128-column tile, 4 K steps
  assert "window_bounds = array<i64: 32, 8, 32>" in kernel  # x: 32 blocks of 32, 8 rows
  assert "window_bounds = array<i64: 1, 1024, 128>" in kernel  # the int8 tile
  assert "window_bounds = array<i64: 1, 32, 128>" in kernel  # the scale tile row
  assert "scratch_operands = 1" in kernel  # the fp32 carry
  assert kernel.count("tpu.matmul") == 32  # one dot per Q8_0 block, unrolled
  assert ("contract_precision<fp32>" in kernel) == (dtype == jnp.float32)


def test_tpu_form_lowers_with_a_smaller_k_step():
  """K = 33 Q8_0 blocks: three K steps of 11 blocks, no padding of the weight."""
  (call,) = custom_calls(lower("tpu", "tpu", operand_specs(3, 1056, 384, jnp.bfloat16)))
  kernel = mosaic_text(call)
  assert "iteration_bounds = array<i64: 3, 3>" in kernel
  assert "window_bounds = array<i64: 11, 8, 32>" in kernel
  assert "window_bounds = array<i64: 1, 11, 128>" in kernel
  assert kernel.count("tpu.matmul") == 11


def test_tpu_form_takes_at_most_8_rows():
  with pytest.raises(ValueError, match="m=16 > 8 tile rows"):
    lower("tpu", "tpu", operand_specs(16, 1024, 128, jnp.bfloat16))


def test_tpu_form_does_not_lower_for_cuda():
  """Why there is a GPU form: the Mosaic kernel (its VMEM carry, its TPU compiler
  params) has no CUDA lowering."""
  with pytest.raises(Exception, match="(?i)memory space|cannot be used for gpu"):
    lower("tpu", "cuda", operand_specs(1, 1024, 128, jnp.bfloat16))


@pytest.mark.parametrize("m,dtype", [(1, jnp.bfloat16), (8, jnp.bfloat16), (16, jnp.float32)])
def test_gpu_form_lowers_to_triton(m, dtype):
  module = lower("gpu", "cuda", operand_specs(m, 4096, 200, dtype))
  (call,) = custom_calls(module)
  assert target(call) == TRITON_CUSTOM_CALL
  attrs, kernel = triton_config(call)
  assert attrs["name"] == '"q8_fold_gpu"'
  assert attrs["num_warps"].startswith("4") and attrs["num_stages"].startswith("4")
  assert attrs["grid_x"].startswith("4")  # 200 columns -> 4 tiles of 64
  # 4 column tiles for 132 SMs: K splits into 128 / 8 = 16 slices of 8 blocks (64 programs)
  assert attrs["grid_y"].startswith("16")
  assert "scf.for" in kernel  # the K slice's loop runs inside the kernel
  dots = re.findall(r"tt\.dot .*", kernel)
  assert len(dots) == 4  # 4 Q8_0 blocks a loop step
  assert all("tensor<16x32x" in d and "tensor<32x64x" in d for d in dots)
  if dtype == jnp.float32:
    assert "inputPrecision = tf32" not in kernel  # float32 rows dot in IEEE fp32, not TF32
  (store,) = re.findall(r"tt\.store .*", kernel)
  # m < 16: only the live rows are stored (a masked store: pointers, values, mask)
  assert (store.count("%") == 3) == (m < 16)
  # XLA adds the 16 partials: a reduce over the slices of the live rows
  assert f"tensor<16x{m}x256xf32>" in str(module) and "stablehlo.reduce" in str(module)


def test_gpu_form_lowers_without_splitting_wide_n():
  """8192 x 28672: 448 column tiles fill 132 SMs, so one K slice and no reduction."""
  module = lower("gpu", "cuda", operand_specs(1, 8192, 28672, jnp.bfloat16))
  (call,) = custom_calls(module)
  attrs, _ = triton_config(call)
  assert attrs["grid_x"].startswith("448") and attrs["grid_y"].startswith("1 ")
  assert "stablehlo.reduce" not in str(module)


def test_gpu_form_takes_at_most_16_rows():
  with pytest.raises(ValueError, match="m=17 > 16 tile rows"):
    lower("gpu", "cuda", operand_specs(17, 1024, 128, jnp.bfloat16))


def test_gradient_lowers_for_tpu():
  """The backward pass is XLA; the forward kernel stays one Mosaic call."""
  x, q, s = operand_specs(8, 2048, 256, jnp.float32)

  def loss(x, q, s):
    return jnp.sum(q8_fold(x, q, s, backend="tpu", interpret=False))

  module = (
    jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
    .trace(x, q, s)
    .lower(lowering_platforms=("tpu",))
  )
  calls = custom_calls(module.compiler_ir("stablehlo"))
  assert [target(c) for c in calls] == [MOSAIC_CUSTOM_CALL]
