"""The chunked XLA Q8_0 product against float64 references of the dequantised weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.kernels.matmul.xla_chunked import default_chunk, q8_matmul_xla
from q8rules.q8_0 import BLOCK, Q8Array
from tests._utils import matrix, random_q8, random_x, rel_err, weight64

TOL = 1e-6


SHAPES = [
  # (m, K, N)
  (1, 32, 1),
  (3, 32, 7),
  (1, 96, 64),
  (8, 96, 1),
  (3, 288, 40),  # K not a multiple of the 256-row chunk: one 256-row step and a 32-row tail
  (1, 1056, 96),
  (8, 768, 130),
  (64, 512, 72),
  (64, 352, 33),
]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_f32_matches_float64_reference(rng, m, k, n):
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  out = q8_matmul_xla(x, q, scale)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  ref = np.asarray(x, np.float64) @ weight64(q, scale)
  assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("chunk", [32, 64, 96, 160, 256, 512, 4096])
def test_every_chunk_size(rng, chunk):
  """Chunks that divide K, that leave a tail, and that exceed K give the same product."""
  m, k, n = 3, 608, 48
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  ref = np.asarray(x, np.float64) @ weight64(q, scale)
  assert rel_err(q8_matmul_xla(x, q, scale, chunk=chunk), ref) <= TOL


@pytest.mark.parametrize("m,k,n", [(1, 96, 33), (8, 288, 40), (64, 320, 24)])
def test_bf16_activations(rng, m, k, n):
  """bf16 x: exactly the float32 product of the bf16 values (float32 out of q8_matmul_xla),
  and x's dtype out of q8_matmul."""
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k), jnp.bfloat16)
  ref = np.asarray(x.astype(jnp.float32), np.float64) @ weight64(q, scale)
  out = q8_matmul_xla(x, q, scale)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref) <= TOL
  y = q8rules.q8_matmul(x, Q8Array(q=q, scale=scale), implementation="xla")
  assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(out.astype(jnp.bfloat16)))


def test_f16_activations_and_f16_scales(rng):
  m, k, n = 3, 288, 40
  q, scale = random_q8(rng, k, n, np.float16)
  x = random_x(rng, (m, k), jnp.float16)
  ref = np.asarray(x, np.float64) @ weight64(q, scale)
  out = q8_matmul_xla(x, q, scale)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("m", [1, 8])
def test_f16_scales(rng, m):
  k, n = 544, 72
  q, scale = random_q8(rng, k, n, np.float16)
  x = random_x(rng, (m, k))
  ref = np.asarray(x, np.float64) @ weight64(q, scale)
  assert rel_err(q8_matmul_xla(x, q, scale), ref) <= TOL


def test_quantized_weight_through_dispatcher(rng):
  """A weight quantised by `q8rules.quantize`, through `q8_matmul(implementation='xla')`."""
  k, n = 320, 56
  w = q8rules.quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.05)
  x = random_x(rng, (2, 5, k))
  y = q8rules.q8_matmul(x, w, implementation="xla")
  assert y.shape == (2, 5, n) and y.dtype == jnp.float32
  ref = np.asarray(x, np.float64) @ weight64(w.q, w.scale)
  assert rel_err(y, ref) <= TOL


def test_jit_equals_eager_and_is_deterministic(rng):
  m, k, n = 8, 800, 40
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  eager = np.asarray(q8_matmul_xla(x, q, scale))
  jitted = jax.jit(q8_matmul_xla)
  first = np.asarray(jitted(x, q, scale))
  np.testing.assert_array_equal(first, np.asarray(jitted(x, q, scale)))
  ref = np.asarray(x, np.float64) @ weight64(q, scale)
  assert rel_err(eager, ref) <= TOL and rel_err(first, ref) <= TOL


def test_vmap_over_a_batch_of_x(rng):
  b, m, k, n = 4, 3, 288, 24
  q, scale = random_q8(rng, k, n)
  xb = random_x(rng, (b, m, k))
  out = jax.jit(jax.vmap(lambda x: q8_matmul_xla(x, q, scale)))(xb)
  assert out.shape == (b, m, n)
  ref = np.asarray(xb, np.float64) @ weight64(q, scale)
  assert rel_err(out, ref) <= TOL
  for i in range(b):
    assert rel_err(out[i], ref[i]) <= TOL


@pytest.mark.parametrize("m,k,n,chunk", [(1, 96, 40, None), (8, 608, 48, 256), (3, 288, 16, 64)])
def test_grad_wrt_x_is_dy_times_w_transpose(rng, m, k, n, chunk):
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  dy = rng.standard_normal((m, n)).astype(np.float32)

  def loss(x):
    return jnp.sum(q8_matmul_xla(x, q, scale, chunk=chunk) * dy)

  g = jax.jit(jax.grad(loss))(x)
  assert g.shape == x.shape and g.dtype == jnp.float32
  ref = dy.astype(np.float64) @ weight64(q, scale).T
  assert rel_err(g, ref) <= TOL


def test_grad_of_bf16_x_under_vmap(rng):
  b, m, k, n = 2, 3, 160, 24
  q, scale = random_q8(rng, k, n)
  xb = random_x(rng, (b, m, k), jnp.bfloat16)
  dy = rng.standard_normal((b, m, n)).astype(np.float32)

  def loss(x, dy):
    return jnp.sum(q8_matmul_xla(x, q, scale) * dy)

  g = jax.vmap(jax.grad(loss))(xb, dy)
  assert g.dtype == jnp.bfloat16
  ref = dy.astype(np.float64) @ weight64(q, scale).T
  # the gradient is rounded to x's bf16 at the end
  assert rel_err(g, ref) <= 2.0**-8


def test_jvp_is_the_product_of_the_tangent(rng):
  m, k, n = 3, 288, 24
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  dx = random_x(rng, (m, k))
  y, dy = jax.jvp(lambda x: q8_matmul_xla(x, q, scale), (x,), (dx,))
  w = weight64(q, scale)
  assert rel_err(y, np.asarray(x, np.float64) @ w) <= TOL
  assert rel_err(dy, np.asarray(dx, np.float64) @ w) <= TOL


def _largest_float_intermediate(jaxpr: jax.extend.core.Jaxpr) -> int:
  """Elements of the largest floating-point value any equation (at any depth) produces."""
  largest = 0
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      aval = v.aval
      if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
        largest = max(largest, int(np.prod(aval.shape)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      largest = max(largest, _largest_float_intermediate(sub))
  return largest


@pytest.mark.parametrize("mode", ["forward", "grad"])
def test_no_float_weight_wider_than_a_chunk(rng, mode):
  """Neither the product nor its gradient holds a float array bigger than one chunk of W."""
  m, k, n, chunk = 2, 1024, 64, 128
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))

  def f(x):
    return q8_matmul_xla(x, q, scale, chunk=chunk)

  fn = f if mode == "forward" else jax.grad(lambda x: jnp.sum(f(x)))
  largest = _largest_float_intermediate(jax.make_jaxpr(fn)(x).jaxpr)
  assert chunk * n <= largest < 2 * chunk * n


def test_default_chunk_is_a_block_multiple():
  for m in (1, 3, 8, 64, 512):
    for k in (32, 4096, 8192):
      c = default_chunk(m, k, 4096)
      assert c >= BLOCK and c % BLOCK == 0


@pytest.mark.parametrize(
  "xs,qs,ss,match",
  [
    ((2, 64), (32, 8), (1, 8), r"activations of shape \(2, 64\) do not contract .* K=32"),
    ((2, 64), (64, 8), (1, 8), r"scale shape \(1, 8\) does not match values \(64, 8\)"),
    ((2, 48), (48, 8), (1, 8), "K=48 not a multiple of 32"),
  ],
)
def test_mismatched_shapes_raise(xs, qs, ss, match):
  """The implementations trust their operands: `q8_matmul` checks them, naming itself."""
  x = jnp.ones(xs, jnp.float32)
  w = Q8Array(jnp.ones(qs, jnp.int8), jnp.ones(ss, jnp.float32))
  with pytest.raises(ValueError, match="q8_matmul: " + match):
    q8rules.q8_matmul(x, w, implementation="xla")


@pytest.mark.parametrize("n", matrix([768, 700, 200], 768, 200))
def test_column_chunks_for_more_rows_than_a_k_chunk(rng, monkeypatch, n):
  """More rows of x than a K chunk: chunks of N's columns (dividing N, leaving a tail, or the
  whole N), the product, its transposed product (op matmul_t's 'xla') and the gradient in x
  against float64."""
  from q8rules.kernels.matmul import xla_chunked
  from q8rules.kernels.matmul_t.xla import q8_matmul_t_xla

  monkeypatch.setattr(xla_chunked, "CHUNK_BYTES", 4 * 64 * 256)  # 256 columns at K = 64
  m, k = 40, 64
  assert default_chunk(m, k, n) < m
  want = {768: 256, 700: 256, 200: 200}[n]
  assert xla_chunked.column_chunk(m, k, n) == want
  assert xla_chunked.column_chunk(8, k, n) is None  # decode keeps the K chunks
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  dy = random_x(rng, (m, n))
  w = weight64(q, scale)
  assert rel_err(q8_matmul_xla(x, q, scale), np.asarray(x, np.float64) @ w) <= TOL
  assert rel_err(q8_matmul_t_xla(dy, q, scale), np.asarray(dy, np.float64) @ w.T) <= TOL
  grad = jax.grad(lambda x: jnp.sum(q8_matmul_xla(x, q, scale) * dy))(x)
  assert rel_err(grad, np.asarray(dy, np.float64) @ w.T) <= TOL
  dscale = random_x(rng, scale.shape)
  _, tangent = jax.jvp(lambda s: q8_matmul_xla(x, q, s), (scale,), (dscale,))
  assert rel_err(tangent, np.asarray(x, np.float64) @ weight64(q, dscale)) <= TOL
