"""Property tests (hypothesis, derandomized, few examples): the quantizer against gguf.quants
over random shapes, axes, dtypes and value ranges; every host implementation of `q8_matmul`
against float64; the weight layout of random einsums."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import q8rules
from q8rules import kernels
from q8rules.layout import from_einsum
from q8rules.q8_0 import BLOCK
from tests._utils import close_to_float64, random_q8, random_x, weight64
from tests.test_q8_0 import gguf_blocks, reference_f32

SETTINGS = dict(
  derandomize=True,  # the same examples every run
  deadline=None,  # compiles make single examples slow
  suppress_health_check=[HealthCheck.too_slow],
  print_blob=True,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KINDS = ("normal", "wide", "subnormal", "tiny", "near_max", "ties", "sparse")


def values(rng: np.random.Generator, shape: tuple[int, ...], kind: str, dtype) -> np.ndarray:
  """Finite float32 values of `shape`, exactly representable in `dtype`, of one range."""
  finfo = jnp.finfo(dtype)
  big, tiny_normal = float(finfo.max), float(finfo.tiny)
  n = int(np.prod(shape))
  if kind == "normal":
    v = rng.standard_normal(n)
  elif kind == "wide":  # magnitudes over the dtype's whole normal range
    lo, hi = np.log10(tiny_normal), np.log10(big) - 0.01
    v = rng.choice([-1, 1], n) * 10.0 ** rng.uniform(lo, hi, n)
  elif kind == "subnormal":  # below the smallest normal of the dtype (float32's for float32)
    v = rng.uniform(-1, 1, n) * tiny_normal
  elif kind == "tiny":  # float32 subnormals and the smallest normals, whatever the dtype
    v = rng.uniform(-1, 1, n) * 10.0 ** rng.uniform(-45, -36, n)
  elif kind == "near_max":
    v = rng.uniform(0.5, 1.0, n) * big * rng.choice([-1, 1], n)
  elif kind == "ties":  # d = 1 where a block holds +-127: every other value an exact .5 tie
    v = rng.integers(-126, 126, n) + 0.5
    v[rng.integers(n)] = 127.0
  else:  # mostly zeros: zero blocks and lone values
    v = np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 5))
  v = np.asarray(v, np.float64).astype(np.float32)
  v = np.clip(v, -big, big)  # stay finite in the dtype (non-finite weights are refused)
  return np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)).reshape(shape)


@st.composite
def quantizer_cases(draw):
  rank = draw(st.integers(1, 3))
  axis = draw(st.integers(-rank, rank - 1))
  shape = [draw(st.integers(1, 5)) for _ in range(rank)]
  shape[axis] = BLOCK * draw(st.integers(1, 4))
  dtype = draw(st.sampled_from(sorted(DTYPES)))
  kind = draw(st.sampled_from(KINDS))
  return tuple(shape), axis, dtype, kind, draw(st.integers(0, 2**32 - 1))


@functools.cache
def _jit_quantize(axis: int, scale_dtype: str):
  return jax.jit(lambda w: q8rules.quantize(w, axis=axis, scale_dtype=scale_dtype))


@pytest.mark.slow
@settings(max_examples=20, **SETTINGS)
@given(case=quantizer_cases(), jit=st.booleans())
def test_quantizer_is_gguf_bit_for_bit(case, jit):
  shape, axis, dtype, kind, seed = case
  w32 = values(np.random.default_rng(seed), shape, kind, DTYPES[dtype])
  w = jnp.asarray(w32, DTYPES[dtype])  # exact: values() made them representable
  if jit:
    a16, a32 = (_jit_quantize(axis, s)(w) for s in ("float16", "float32"))
  else:
    a16, a32 = (q8rules.quantize(w, axis=axis, scale_dtype=s) for s in ("float16", "float32"))
  assert a32.dtype == DTYPES[dtype] and a32.axis == axis % len(shape)
  rows = np.moveaxis(w32, axis, -1)  # gguf blocks along the last axis
  d16_ref, q_ref = gguf_blocks(rows)
  d32_ref, _ = reference_f32(rows)

  def blocks(a, values):  # our (q or scale) in gguf's row order
    return np.moveaxis(np.asarray(values), a.axis, -1)

  np.testing.assert_array_equal(blocks(a32, a32.q).reshape(-1, BLOCK), q_ref)
  np.testing.assert_array_equal(np.asarray(a16.q), np.asarray(a32.q))
  np.testing.assert_array_equal(
    blocks(a16, a16.scale).ravel().view(np.uint16), d16_ref.view(np.uint16)
  )
  np.testing.assert_array_equal(
    blocks(a32, a32.scale).ravel().view(np.uint32), d32_ref.view(np.uint32)
  )


def host_implementations(m: int, k: int, n: int) -> list[str]:
  """Every implementation that can run an (m, K) x (K, N) float32 product on this host."""
  backend = jax.default_backend()
  return [
    name
    for name in kernels.IMPLEMENTATIONS
    if kernels.why_not(name, m, k, n, jnp.float32, backend) is None
  ]


@settings(max_examples=15, **SETTINGS)
@given(
  m=st.integers(1, 24),
  k=st.integers(1, 8).map(lambda b: b * BLOCK),
  n=st.integers(1, 72),
  scale_dtype=st.sampled_from(["float32", "float16"]),
  seed=st.integers(0, 2**32 - 1),
)
@pytest.mark.slow
def test_q8_matmul_every_host_implementation_within_1e6_of_float64(m, k, n, scale_dtype, seed):
  rng = np.random.default_rng(seed)
  q, scale = random_q8(rng, k, n, np.dtype(scale_dtype))
  w = q8rules.Q8Array(q=q, scale=scale)
  x = random_x(rng, (m, k))
  names = host_implementations(m, k, n)
  assert {"xla", "reference"} <= set(names), names
  for name in names:
    y = q8rules.q8_matmul(x, w, implementation=name)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert close_to_float64(y, x, weight64(q, scale), 1e-6), (name, m, k, n)


LETTERS = "abcdefghijklmnopqrstuvwxyz"


@st.composite
def einsum_cases(draw):
  """A weight einsum 'lhs,rhs->out' Q8_0 can serve, with operand shapes: x's free indices,
  contraction indices, the weight's free indices, each in any order; maybe an ellipsis."""
  letters = draw(st.permutations(LETTERS))
  n_free, n_contract, n_out = (draw(st.integers(lo, 2)) for lo in (0, 1, 1))
  free = letters[:n_free]
  contract = letters[n_free : n_free + n_contract]
  w_free = letters[n_free + n_contract : n_free + n_contract + n_out]
  size = {c: draw(st.integers(1, 5)) for c in free + w_free}
  size |= {c: draw(st.sampled_from([1, 3, 8, 16, 32, 40])) for c in contract}
  lhs = "".join(draw(st.permutations(free + contract)))
  rhs = "".join(draw(st.permutations(contract + w_free)))
  out = "".join(draw(st.permutations(free + w_free)))
  lead: tuple[int, ...] = ()
  if draw(st.booleans()):  # leading batch axes as an ellipsis
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    lhs, out = "..." + lhs, "..." + out
  spec = f"{lhs},{rhs}->{out}"
  lhs_shape = lead + tuple(size[c] for c in lhs.replace("...", ""))
  rhs_shape = tuple(size[c] for c in rhs)
  return spec, lhs_shape, rhs_shape, draw(st.integers(0, 2**32 - 1))


@pytest.mark.slow
@settings(max_examples=25, **SETTINGS)
@given(case=einsum_cases())
def test_einsum_layout_round_trip(case):
  spec, lhs_shape, rhs_shape, seed = case
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(lhs_shape).astype(np.float32)
  w = rng.standard_normal(rhs_shape).astype(np.float32)
  layout = from_einsum(spec, len(lhs_shape), rhs_shape)
  k = int(np.prod([rhs_shape[a] for a in layout.weight.contract]))
  assert layout.weight.k == k and layout.weight.k_padded == -(-k // BLOCK) * BLOCK
  w2d = layout.weight.to_matrix(jnp.asarray(w))
  assert w2d.shape == (layout.weight.k_padded, layout.weight.n)
  assert not np.asarray(w2d[k:]).any()  # the padding is zeros
  np.testing.assert_array_equal(np.asarray(layout.weight.from_matrix(w2d)), w)
  x2d = layout.lhs_matrix(jnp.asarray(x))
  y = layout.output(
    jnp.asarray(np.asarray(x2d, np.float64) @ np.asarray(w2d, np.float64)), lhs_shape
  )
  ref = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
  assert y.shape == ref.shape
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-6, atol=1e-6)
