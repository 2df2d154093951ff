"""The precision policy: float32 activations get float32-accurate products on every backend.

q8rules' own products (the fold, the XLA path, the native kernel) accumulate float32 at
`Precision.HIGHEST`; QAT's fake-quantised products ask for HIGHEST unless the op or
`jax.default_matmul_precision` names another. Checked on the lowered program, so the test
says the same on CPU, GPU and TPU.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix

import q8rules
from q8rules.q8_0 import Q8Array
from tests._utils import random_q8, random_x


def test_precision_policy_is_explicit():
  """QAT's float32 products run at float32 precision (HIGHEST) on every backend, forward
  (the serving product) and backward (the fake-quantised one), so QAT computes what serving
  computes (a GPU would otherwise use
  TF32); unmatched products keep the op's default; `jax.default_matmul_precision` wins."""

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="fc")(x) + nn.Dense(8, name="other")(x)

  x = jnp.ones((2, 64), jnp.float32)
  qat = qwix.quantize_model(Two(), q8rules.Q8QatProvider([q8rules.Q8Rule(module_path="fc")]))
  params = qat.init(jax.random.key(0), x)

  def dots(fn) -> list[str]:
    text = jax.jit(fn).lower(params, x).as_text()
    return [
      line.split("precision = ")[1][:18] for line in text.splitlines() if "dot_general" in line
    ]

  def value_and_grad(p, x):
    return jax.value_and_grad(lambda p: qat.apply(p, x).sum())(p)

  found = dots(value_and_grad)
  # fc: its forward is the serving product (a kernel, or an XLA dot at HIGHEST: the test
  # below), its weight gradient a float32 dot at HIGHEST
  assert found.count("[HIGHEST, HIGHEST]") >= 1, found
  assert found.count("[DEFAULT, DEFAULT]") == 2, found  # other: untouched
  assert len(found) == found.count("[HIGHEST, HIGHEST]") + 2, found
  with jax.default_matmul_precision("tensorfloat32"):
    assert "[HIGHEST, HIGHEST]" not in dots(value_and_grad)


def test_q8_products_are_float32_precision(rng):
  """Every dot the XLA path and the reference lower to is HIGHEST (or has no float32 input)."""
  q, scale = random_q8(rng, 256, 64)
  x = random_x(rng, (3, 256))
  for name in ("xla", "reference"):
    text = (
      jax.jit(lambda x, name=name: q8rules.q8_matmul(x, Q8Array(q, scale), implementation=name))
      .lower(x)
      .as_text()
    )
    lines = [line for line in text.splitlines() if "dot_general" in line]
    assert lines and all("HIGHEST" in line for line in lines), (name, lines)
  assert np.isfinite(np.asarray(q8rules.q8_matmul(x, Q8Array(q, scale)))).all()
