"""The QAT tests' models and data, with their numpy Q8_0 references (tests/test_qat*.py).

References are independent of q8rules' layout and quantizer code: numpy's
Q8_0 round trip (llama.cpp's `quantize_row_q8_0_ref` with gguf's `np_roundf`)
on explicitly reshaped weights.
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.quants import np_roundf

import q8rules

F32 = np.float32


def np_fq_matrix(w2d: np.ndarray, scale_dtype=np.float32) -> np.ndarray:
  """Q8_0 round trip of a (K, N) float32 matrix blocked along K (K padded with zeros), numpy."""
  k, n = w2d.shape
  kp = -(-k // 32) * 32
  w = np.zeros((kp, n), F32)
  w[:k] = w2d
  blocks = w.reshape(kp // 32, 32, n)
  d = np.abs(blocks).max(axis=1, keepdims=True) / F32(127)
  inv = np.where(d == 0, F32(0), F32(1) / np.where(d == 0, F32(1), d)).astype(F32)
  q = np_roundf(blocks * inv)
  d_stored = d.astype(scale_dtype).astype(F32)
  return (q * d_stored).astype(F32).reshape(kp, n)[:k]


def np_fq(w: np.ndarray, n_contract: int, scale_dtype=np.float32) -> np.ndarray:
  """Round trip of a weight whose first `n_contract` axes are contracted (every test weight here)."""
  w = np.asarray(w, F32)
  k = int(np.prod(w.shape[:n_contract]))
  return np_fq_matrix(w.reshape(k, -1), scale_dtype).reshape(w.shape)


def randomize(params, rng: np.random.Generator, scale: float = 0.3):
  """Fresh random float32 params (biases too, so nothing is zero)."""
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, scale, a.shape), a.dtype), params)


# ---- models -------------------------------------------------------------------


class LinenNet(nn.Module):
  """x (B, T, 40) -> (B, T, 10): Dense (K=40, padded), DenseGeneral, two-axis Einsum, unmatched head."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(nn.Dense(96, name="up")(x))
    h = nn.DenseGeneral((4, 8), name="heads")(h)  # kernel (96, 4, 8)
    h = jnp.tanh(nn.Einsum((4, 8, 24), "btnh,nhd->btd", name="out")(h))  # kernel (4, 8, 24)
    return nn.Dense(10, name="head")(h)


LINEN_RULES = [q8rules.Q8Rule(module_path="up|heads|out")]
LINEN_CONTRACT = {"up": 1, "heads": 1, "out": 2}  # matched kernels: leading contracted axes


def linen_fq_params(params, scale_dtype=np.float32):
  """The params with every matched kernel replaced by its numpy Q8_0 round trip."""
  out = jax.tree.map(np.asarray, flax.core.unfreeze(params))
  for name, nc in LINEN_CONTRACT.items():
    out[name]["kernel"] = np_fq(out[name]["kernel"], nc, scale_dtype)
  return out


class NnxNet(nnx.Module):
  """x (B, T, 40) -> (B, T, 24): nnx.Linear (K=40), nnx.Einsum, jnp.dot on a raw Param.

  (Weight shapes as LinenNet's, so eager conversions reuse compiled ops.)
  """

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(40, 96, rngs=rngs)
    self.ein = nnx.Einsum("btd,dnh->btnh", (96, 4, 8), (4, 8), rngs=rngs)
    self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 24)) / 6)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jnp.tanh(self.ein(jax.nn.gelu(self.up(x))))
    return jnp.dot(h.reshape(*h.shape[:-2], 32), self.w[...])


NNX_RULES = [q8rules.Q8Rule()]


def nnx_fq_params(pure: dict) -> dict:
  out = jax.tree.map(np.asarray, pure)
  out["up"]["kernel"] = np_fq(out["up"]["kernel"], 1)
  out["ein"]["kernel"] = np_fq(out["ein"]["kernel"], 1)
  out["w"] = np_fq(out["w"], 1)
  return out


def nnx_model(rng: np.random.Generator) -> NnxNet:
  """An NnxNet with fresh random params (built abstractly: no eager init ops)."""
  net = nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0)))
  nnx.update(net, randomize(nnx.state(net, nnx.Param), rng))
  return net


def linen_params(model: nn.Module, x: jax.Array, rng: np.random.Generator):
  """Fresh random params of the model's structure (built abstractly: no eager init ops)."""
  return randomize(jax.eval_shape(model.init, jax.random.key(0), x)["params"], rng)


def data(
  rng: np.random.Generator, b: int = 4, t: int = 3, out: int = 10
) -> tuple[jax.Array, jax.Array]:
  """Inputs float32 (b, t, 40) and regression targets float32 (b, t, out)."""
  x = jnp.asarray(rng.normal(size=(b, t, 40)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(b, t, out)), jnp.float32)
  return x, y


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((pred - y) ** 2)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    h = jnp.tanh(nn.Dense(64, name="fc1")(x))  # kernel (48, 64): K padded to 64
    return x + nn.Dense(48, name="fc2")(h), None  # kernel (64, 48)


class ScanNet(nn.Module):
  """x (B, 48) -> (B, 10) through 3 scanned, rematerialised blocks (params stacked on axis 0)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    layers = nn.scan(
      nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, _ = layers(name="layers")(x, None)
    return nn.Dense(10, name="head")(x)


def scan_fq_params(params):
  out = jax.tree.map(np.asarray, flax.core.unfreeze(params))
  for fc in ("fc1", "fc2"):
    stacked = out["layers"][fc]["kernel"]
    out["layers"][fc]["kernel"] = np.stack([np_fq(w, 1) for w in stacked])  # each layer alone
  return out
