"""The grouped product of experts with Q8_0 activations (`act_qtype='q8_0'`, as llama.cpp
multiplies its Q8_0 experts): every implementation against a float64 reference built from the
activations' Q8_0 blocks, the native int8 kernel bit for bit with the dense Q8_0 x Q8_0 product
on each expert's rows, its straight-through gradient and its errors. MoE GGUF files run this
way are in tests/test_llm_moe.py (their logits then are llama.cpp's own Q8_0 run's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.kernels import q8_matmul
from q8rules.kernels.matmul_act_q8.reference import reference_float64
from q8rules.kernels.ragged_matmul import api as ragged_api
from q8rules.kernels.ragged_matmul.api import q8_ragged_matmul, resolve_ragged
from q8rules.q8_0 import Q8Array
from tests._utils import matrix, rel_err
from tests.test_ragged_matmul import CASES, experts, random_x, skip_unless_runs

IMPLEMENTATIONS = ("reference", "xla", "cpu")


def act_reference64(x, w: Q8Array, sizes) -> np.ndarray:
  """Each expert's rows through the Q8_0 x Q8_0 float64 reference (exact block dots), x
  zero-padded to the weight's K; rows past the groups' sum are zeros."""
  x = np.asarray(jnp.asarray(x, jnp.float32))
  x = np.pad(x, ((0, 0), (0, w.shape[1] - x.shape[1])))
  out = np.zeros((x.shape[0], w.shape[2]))
  bounds = np.cumsum((0, *sizes))
  for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
    if b > a:
      out[a:b] = reference_float64(x[a:b], np.asarray(w.q[e]), np.asarray(w.scale[e]))
  return out


@pytest.mark.parametrize("name", matrix(IMPLEMENTATIONS, "xla", "cpu"))
@pytest.mark.parametrize("sizes,k,n", matrix(CASES, CASES[0]))
def test_matches_the_q8_0_activations_float64(rng, name, sizes, k, n):
  skip_unless_runs(name)
  w = experts(rng, len(sizes), -(-k // 32) * 32, n, np.float16)
  x = random_x(rng, sum(sizes), k)
  gs = jnp.asarray(sizes, jnp.int32)
  y = q8_ragged_matmul(x, w, gs, implementation=name, act_qtype="q8_0")
  ref = act_reference64(x, w, sizes)
  assert rel_err(y, ref) <= 1e-6
  plain = q8_ragged_matmul(x, w, gs, implementation=name)  # the activations' rounding shows
  assert rel_err(plain, ref) > 1e-4


def test_the_native_int8_kernel_is_each_experts_dense_product_bit_for_bit(rng, cpu_isa):
  """On each SIMD path the native grouped product runs the int8 kernel: each expert's rows get
  the dense Q8_0 x Q8_0 kernel's bits, on one thread and on two, with K cut into units and N
  past whole 64-column stretches."""
  skip_unless_runs("cpu")
  sizes, k, n = (1, 0, 3, 2, 9), 2048, 130
  w = experts(rng, len(sizes), k, n, np.float16)
  x = random_x(rng, sum(sizes), k)
  gs = jnp.asarray(sizes, jnp.int32)
  bounds = np.cumsum((0, *sizes))
  each = [
    q8_matmul(x[a:b], Q8Array(w.q[e], w.scale[e]), implementation="cpu", act_qtype="q8_0")
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    if b > a
  ]
  expected = np.concatenate(each)
  try:
    for threads in (1, 2):
      q8rules.set_cpu_threads(threads)
      y = q8_ragged_matmul(x, w, gs, implementation="cpu", act_qtype="q8_0")
      np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
  finally:
    q8rules.set_cpu_threads(None)


def test_the_default_implementation_per_backend(rng):
  """`implementation=None` takes the dispatcher's choice for this backend, with the same
  numerics whatever it is."""
  sizes, k, n = (3, 0, 5), 64, 48
  w = experts(rng, len(sizes), k, n)
  x = random_x(rng, sum(sizes), k)
  chosen = resolve_ragged(x.shape[0], k, n, len(sizes), x.dtype)
  assert chosen in ragged_api.DEFAULT_ORDER[jax.default_backend()]
  y = q8_ragged_matmul(x, w, jnp.asarray(sizes, jnp.int32), act_qtype="q8_0")
  assert rel_err(y, act_reference64(x, w, sizes)) <= 1e-6


@pytest.mark.parametrize("name", matrix(["xla", "cpu"], "cpu"))
def test_gradients_are_the_weight_only_products(rng, name):
  """A straight-through estimator on the activations' rounding: d/dx and d/dscale are the
  weight-only product's."""
  skip_unless_runs(name)
  sizes, k, n = (2, 0, 3), 64, 40
  w = experts(rng, len(sizes), k, n)
  x = random_x(rng, sum(sizes), k)
  gs = jnp.asarray(sizes, jnp.int32)
  dy = jnp.asarray(rng.standard_normal((sum(sizes), n)).astype(np.float32))

  def loss(x, scale, act_qtype):
    y = q8_ragged_matmul(x, Q8Array(w.q, scale, axis=1), gs, implementation=name,
                         act_qtype=act_qtype)  # fmt: skip
    return jnp.sum(y * dy)

  got = jax.grad(loss, argnums=(0, 1))(x, w.scale, "q8_0")
  want = jax.grad(loss, argnums=(0, 1))(x, w.scale, None)
  for g, h in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


def test_an_unknown_act_qtype_is_refused(rng):
  w = experts(rng, 2, 32, 8)
  with pytest.raises(ValueError, match="act_qtype='q4_0'"):
    q8_ragged_matmul(jnp.ones((2, 32)), w, jnp.asarray([1, 1], jnp.int32), act_qtype="q4_0")
