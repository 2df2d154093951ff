"""Every implementation of the Q8_0 product on the same float64-reference cases (tokamax-style),
and the dispatch: `resolve`, and a `jax.export` that carries each platform's kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from q8rules.kernels import IMPLEMENTATIONS, REGISTRY, q8_matmul, resolve_product, why_not
from q8rules.kernels.matmul._pallas_compat import MOSAIC_CUSTOM_CALL, TRITON_CUSTOM_CALL
from q8rules.kernels.native.library import TARGET as CPU_TARGET
from q8rules.q8_0 import Q8Array
from tests._utils import close_to_float64, lowering_for, random_q8, random_x, weight64

# (m, K, N): one row, a few rows, a tile's worth of rows (8 fits every fold form), N = 1, a
# padded column tile, K of one block and of several K steps.
CASES = [(1, 32, 1), (3, 96, 40), (8, 1024, 130), (1, 2048, 64)]


def runnable_here(name: str, m: int, k: int, n: int) -> bool:
  return why_not(name, m, k, n, jnp.float32) is None


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("m,k,n", CASES)
def test_matches_float64(rng, name, m, k, n):
  """f32 activations: within 1e-6 of float64 (relative to the magnitudes summed)."""
  if not runnable_here(name, m, k, n):
    pytest.skip(f"{name} cannot run here: {why_not(name, m, k, n, jnp.float32)}")
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  y = jax.jit(lambda x: q8_matmul(x, Q8Array(q, scale), implementation=name))(x)
  assert y.shape == (m, n) and y.dtype == jnp.float32
  assert close_to_float64(y, x, weight64(q, scale), 1e-6)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_bf16_and_float16_scales(rng, name):
  m, k, n = 3, 256, 72
  if not runnable_here(name, m, k, n):
    pytest.skip(f"{name} cannot run here")
  q, scale = random_q8(rng, k, n, scale_dtype=np.float16)
  x = random_x(rng, (m, k), jnp.bfloat16)
  y = q8_matmul(x, Q8Array(q, scale), implementation=name, preferred_element_type=jnp.float32)
  # bf16 inputs are exact in float32: the bound is float32 accumulation's, or bf16's where the
  # implementation rounds the weight to the activations' dtype
  tol = 1e-2 if REGISTRY[name].rounds_weight else 1e-6
  assert close_to_float64(y, x.astype(jnp.float32), weight64(q, scale), tol)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_grad_matches_float64(rng, name):
  m, k, n = 2, 128, 48
  if not runnable_here(name, m, k, n):
    pytest.skip(f"{name} cannot run here")
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  cot = rng.standard_normal((m, n))
  dx, ds = jax.grad(
    lambda x, s: jnp.sum(q8_matmul(x, Q8Array(q, s), implementation=name) * cot), argnums=(0, 1)
  )(x, scale)
  w64 = weight64(q, scale)
  np.testing.assert_allclose(dx, cot @ w64.T, rtol=1e-5, atol=1e-5 * np.abs(cot @ w64.T).max())
  qb = np.asarray(q, np.float64).reshape(k // 32, 32, n)
  ref_ds = np.einsum("rbi,bin,rn->bn", np.asarray(x, np.float64).reshape(m, k // 32, 32), qb, cot)
  np.testing.assert_allclose(ds, ref_ds, rtol=1e-5, atol=1e-5 * np.abs(ref_ds).max())


def test_every_implementation_is_registered_with_a_reason():
  for name, impl in REGISTRY.items():
    assert impl.name == name and impl.summary


def test_resolve_names_what_cannot_run():
  with pytest.raises(ValueError, match=r"'cpu': the native CPU kernel runs on the CPU only"):
    resolve_product(1, 4096, 4096, backend="tpu", implementation="cpu")
  assert resolve_product(1, 4096, 4096, backend="tpu", implementation=("cpu", "xla")) == "xla"


def test_export_carries_each_platforms_kernel(rng):
  """One export for ('cpu', 'cuda', 'tpu') from this host: the TPU module runs the Mosaic fold,
  the CUDA module the Triton fold, the CPU module the native kernel (or XLA where it is
  unavailable); the artifact runs here with the CPU's kernel."""
  m, k, n = 1, 1024, 128
  q, scale = random_q8(rng, k, n)
  x = random_x(rng, (m, k))
  f = jax.jit(lambda x, q, s: q8_matmul(x, Q8Array(q, s)))
  targets = (CPU_TARGET, TRITON_CUSTOM_CALL, MOSAIC_CUSTOM_CALL)
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
  with lowering_for(("cpu", "cuda", "tpu")):
    exp = export.export(f, platforms=("cpu", "cuda", "tpu"), disabled_checks=checks)(x, q, scale)
  text = exp.mlir_module()
  assert MOSAIC_CUSTOM_CALL in text and TRITON_CUSTOM_CALL in text
  assert (CPU_TARGET in text) == (resolve_product(m, k, n, jnp.float32, "cpu") == "cpu")
  for platform, expected in (("tpu", MOSAIC_CUSTOM_CALL), ("cuda", TRITON_CUSTOM_CALL)):
    with lowering_for((platform,)):
      one = export.export(f, platforms=(platform,), disabled_checks=checks)(x, q, scale)
    assert expected in one.mlir_module(), platform
  if jax.default_backend() == "cpu":
    y = exp.call(x, q, scale)
    assert close_to_float64(y, x, weight64(q, scale), 1e-6)


def test_never_picks_the_fold_on_a_gpu_too_old_for_triton(monkeypatch):
  """A Colab T4 (compute capability 7.5): Pallas Triton cannot run there, so
  `implementation=None` takes an XLA path and a forced 'fold' says why; an H100 (9.0) runs
  the fold. Faked: this host has no GPU."""
  from q8rules.kernels.matmul import pallas_triton

  monkeypatch.setattr(pallas_triton, "compute_capability", lambda: (7, 5))
  assert resolve_product(1, 4096, 4096, jnp.bfloat16, backend="gpu") == "xla_dequant"
  with pytest.raises(ValueError, match="compute capability 8.0 or newer; this GPU has 7.5"):
    resolve_product(1, 4096, 4096, jnp.bfloat16, backend="gpu", implementation="fold")
  assert (
    resolve_product(1, 4096, 4096, jnp.bfloat16, backend="tpu") == "fold"
  )  # TPUs are unaffected
  monkeypatch.setattr(pallas_triton, "compute_capability", lambda: (9, 0))
  assert resolve_product(1, 4096, 4096, jnp.bfloat16, backend="gpu") == "fold"
  monkeypatch.setattr(pallas_triton, "compute_capability", lambda: None)  # no GPU: export
  assert resolve_product(1, 4096, 4096, jnp.bfloat16, backend="gpu") == "fold"
