"""A CNN under the default `Q8Rule()`: Dense layers become Q8_0, convolutions stay float.

Qwix's PTQ provider intercepts `jax.lax.conv_general_dilated` too; Q8_0 serves
products only, so every op Qwix intercepts that q8rules does not serve runs
float, with an `OpRecord` of path 'float' and a note.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules._qwix import WithAux
from q8rules.q8_0 import BLOCK
from tests._utils import rel_err


def conv_same_f64(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
  """'SAME' stride-1 convolution in float64: x (B, H, W, C), w (kh, kw, C, O) -> (B, H, W, O)."""
  kh, kw = w.shape[:2]
  top, left = (kh - 1) // 2, (kw - 1) // 2
  xp = np.pad(x, ((0, 0), (top, kh - 1 - top), (left, kw - 1 - left), (0, 0)))
  out = np.zeros((*x.shape[:3], w.shape[3]))
  for i in range(kh):
    for j in range(kw):
      out += xp[:, i : i + x.shape[1], j : j + x.shape[2]] @ w[i, j]
  return out + b


def q8_f64(w: WithAux) -> np.ndarray:
  """A (K, N) Q8 weight dequantised in float64 (K not padded in these models)."""
  q = np.asarray(w.array.q, np.float64)
  return q * np.repeat(np.asarray(w.array.scale, np.float64), BLOCK, axis=0)


def cnn_f64(conv1, conv2, dense1, dense2, x) -> np.ndarray:
  """The CNN in float64: each conv/dense is (weight float64, bias float64)."""
  h = np.maximum(conv_same_f64(np.asarray(x, np.float64), *conv1), 0)
  h = np.maximum(conv_same_f64(h, *conv2), 0)
  h = h.reshape(h.shape[0], -1)
  h = np.maximum(h @ dense1[0] + dense1[1], 0)
  return h @ dense2[0] + dense2[1]


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):  # x (B, 8, 8, 3)
    x = jax.nn.relu(nn.Conv(8, (3, 3), name="conv1")(x))
    x = jax.nn.relu(nn.Conv(4, (3, 3), name="conv2")(x))
    x = x.reshape(x.shape[0], -1)  # (B, 256)
    x = jax.nn.relu(nn.Dense(64, name="dense1")(x))
    return nn.Dense(10, name="dense2")(x)


class NnxCNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(8, 4, (3, 3), rngs=rngs)
    self.dense1 = nnx.Linear(256, 64, rngs=rngs)
    self.dense2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.conv1(x))
    x = jax.nn.relu(self.conv2(x))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(self.dense1(x))
    return self.dense2(x)


def assert_report(report: q8rules.Report) -> None:
  """Convs: path 'float' with the note; Denses: quantized."""
  by_module = {r.module: r for r in report.ops}
  for name, kernel in (("conv1", (3, 3, 3, 8)), ("conv2", (3, 3, 8, 4))):
    r = by_module[name]
    assert r.op == "conv_general_dilated0" and r.path == "float" and r.q8_bytes == 0, r
    assert r.weight_shape == kernel
    assert "conv_general_dilated is not served as Q8_0" in r.note
  for name in ("dense1", "dense2"):
    assert by_module[name].path != "float" and by_module[name].q8_bytes > 0
  assert "left float" in str(report)


@pytest.mark.slow
def test_linen_cnn_dense_q8_conv_float(rng):
  model = LinenCNN()
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 3)), jnp.float32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8_model = qwix.quantize_model(model, provider)
  q8_params = q8_model.init(jax.random.key(0), x)["params"]
  for name in ("conv1", "conv2"):
    assert not isinstance(q8_params[name]["kernel"], WithAux)
    assert q8_params[name]["kernel"].dtype == jnp.float32
  for name in ("dense1", "dense2"):
    assert isinstance(q8_params[name]["kernel"].array, q8rules.Q8Array)

  y = q8_model.apply({"params": q8_params}, x)
  p = q8_params
  ref = cnn_f64(
    *[
      (np.asarray(p[n]["kernel"], np.float64), np.asarray(p[n]["bias"])) for n in ("conv1", "conv2")
    ],
    *[(q8_f64(p[n]["kernel"]), np.asarray(p[n]["bias"], np.float64)) for n in ("dense1", "dense2")],
    x,
  )
  assert rel_err(y, ref) <= 1e-5
  assert_report(provider.report())

  # a float checkpoint converts: conv weights pass through as they are
  float_params = model.init(jax.random.key(1), x)["params"]
  converted = q8rules.quantize_params(float_params, jax.eval_shape(lambda: q8_params))
  np.testing.assert_array_equal(converted["conv1"]["kernel"], float_params["conv1"]["kernel"])
  assert isinstance(converted["dense1"]["kernel"].array, q8rules.Q8Array)
  assert jnp.all(jnp.isfinite(q8_model.apply({"params": converted}, x)))


@pytest.mark.slow
def test_nnx_cnn_dense_q8_conv_float(rng):
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 3)), jnp.float32)
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  q8_model = qwix.quantize_model(NnxCNN(nnx.Rngs(0)), provider, x)
  m = q8_model
  for conv in (m.conv1, m.conv2):
    assert not isinstance(conv.kernel[...], WithAux)
  for dense in (m.dense1, m.dense2):
    assert isinstance(dense.kernel[...], WithAux)

  x2 = jnp.asarray(rng.standard_normal((2, 8, 8, 3)), jnp.float32)
  ref = cnn_f64(
    *[
      (np.asarray(c.kernel[...], np.float64), np.asarray(c.bias[...], np.float64))
      for c in (m.conv1, m.conv2)
    ],
    *[(q8_f64(d.kernel[...]), np.asarray(d.bias[...], np.float64)) for d in (m.dense1, m.dense2)],
    x2,
  )
  assert rel_err(q8_model(x2), ref) <= 1e-5
  assert rel_err(nnx.jit(lambda mod, v: mod(v))(q8_model, x2), ref) <= 1e-5
  assert_report(provider.report())
