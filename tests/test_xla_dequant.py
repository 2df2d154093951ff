"""The dequantise-then-dot product (`xla_dequant`): its accuracy per dtype against float64,
its pieces, and where `resolve` picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.kernels import REGISTRY, q8_matmul, resolve_product
from q8rules.kernels.matmul.xla_dequant import dequant_dtype, piece_rows, q8_matmul_dequant
from q8rules.q8_0 import BLOCK, Q8Array
from tests._utils import close_to_float64, random_q8, random_x, weight64


def test_piece_rows():
  assert piece_rows(4096, 14336, 2) == 4096  # 117 MiB of bf16: one piece
  assert piece_rows(8192, 28672, 2, budget=256 << 20) == 4672  # whole blocks under the budget
  assert piece_rows(1024, 128, 4, budget=4 * 128 * 100) == 96  # 100 rows -> 3 blocks
  assert piece_rows(1024, 128, 4, budget=1) == BLOCK  # at least one block


def test_dequant_dtype():
  assert dequant_dtype(jnp.bfloat16) == jnp.bfloat16
  assert dequant_dtype(jnp.float16) == jnp.float16
  assert dequant_dtype(jnp.float32) == jnp.float32


@pytest.mark.parametrize("piece_bytes", [1 << 30, 4 * 40 * 96])  # one piece; 3 pieces + 32 rows
def test_float32_within_float32_of_float64(rng, piece_bytes):
  """float32 activations: a float32 weight dotted at HIGHEST, piece by piece."""
  m, k, n = 5, 320, 40
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  y = jax.jit(lambda x: q8_matmul_dequant(x, q, scale, piece_bytes=piece_bytes))(x)
  assert y.shape == (m, n) and y.dtype == jnp.float32
  assert close_to_float64(y, x, weight64(q, scale), 1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_16_bit_rows_round_the_weight(rng, dtype, tol):
  """16-bit activations meet the weight rounded to their dtype: within that dtype's accuracy
  of float64 (against the activations as stored), and exactly the dot of the rounded weight."""
  m, k, n = 6, 256, 72
  q, scale = random_q8(rng, k, n, scale_dtype=np.float16)
  x = random_x(rng, (m, k), dtype)
  y = q8_matmul_dequant(x, q, scale)
  w64 = weight64(q, scale)
  assert close_to_float64(y, x.astype(jnp.float32), w64, tol)
  assert not close_to_float64(y, x.astype(jnp.float32), w64, 1e-7)  # the weight was rounded
  w16 = np.asarray(jnp.asarray(w64, jnp.float32).astype(dtype), np.float64)
  assert close_to_float64(y, x.astype(jnp.float32), w16, 1e-6)
  pieces = q8_matmul_dequant(x, q, scale, piece_bytes=2 * n * 64)  # 4 pieces of 64 rows
  assert close_to_float64(pieces, x.astype(jnp.float32), w16, 1e-6)


def test_registered_and_picked_for_many_rows_on_accelerators(rng):
  assert REGISTRY["xla_dequant"].rounds_weight and not REGISTRY["fold"].rounds_weight
  for backend in ("gpu", "tpu"):
    assert resolve_product(512, 4096, 14336, jnp.bfloat16, backend=backend) == "xla_dequant"
    assert resolve_product(1, 4096, 14336, jnp.bfloat16, backend=backend) == "fold"
  assert resolve_product(512, 4096, 14336, jnp.bfloat16, backend="cpu") == "xla"
  q, scale = random_q8(rng, 128, 48)
  x = random_x(rng, (2, 3, 128), jnp.bfloat16)
  y = q8_matmul(x, Q8Array(q, scale), implementation="xla_dequant")
  assert y.shape == (2, 3, 48) and y.dtype == jnp.bfloat16
  direct = q8_matmul_dequant(x.reshape(6, 128), q, scale).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(y).reshape(6, 48), np.asarray(direct))


@pytest.mark.parametrize("dtype,operand", [(jnp.bfloat16, "bf16"), (jnp.float32, "f32")])
def test_prefill_lowers_for_cuda_to_one_dot(dtype, operand):
  """On CUDA, 128 rows take `xla_dequant`: no kernel call, one dot of the dequantised weight in
  the activations' dtype (float32 rows at HIGHEST: no TF32)."""
  q = jax.ShapeDtypeStruct((1024, 256), jnp.int8)
  s = jax.ShapeDtypeStruct((32, 256), jnp.float32)
  x = jax.ShapeDtypeStruct((128, 1024), dtype)
  f = jax.jit(lambda x, q, s: q8_matmul(x, Q8Array(q, s)))
  text = str(f.trace(x, q, s).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo"))
  assert "custom_call" not in text
  (dot,) = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert f"tensor<128x1024x{operand}>, tensor<1024x256x{operand}>) -> tensor<128x256xf32>" in dot
  assert ("HIGHEST" in dot) == (dtype == jnp.float32)
