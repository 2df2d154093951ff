"""A LoRA block for tests/test_lora_scan.py and tests/test_lora_mesh.py, and its float64 pass.

Block: x (B, T, D) -> x + down(tanh(up(x))), `up` a Dense (D, F) (a column-parallel weight on a
mesh), `down` an Einsum 'btf,fhk->bthk' (F, H, KH) back to D = H * KH (row-parallel). D = 48 is
padded to 64 rows as Q8_0 (K of `up`); F = 128 splits into whole 32-row blocks over 4 devices.
Both products carry a Q8_0 base and an adapter: y = x @ W + x @ A @ B * ALPHA / RANK.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import q8rules
from tests._utils import weight64

D, F, H, KH = 48, 128, 4, 12
RANK, ALPHA = 4, 6.0
SCALE = ALPHA / RANK
X_SHAPE = (2, 3, D)
NAMES = ("up", "down")


def rules(prefix: str = "") -> list[q8rules.Q8Rule]:
  """One Q8LoraRule for both products (under `prefix`, e.g. 'layers/')."""
  return [q8rules.Q8LoraRule(module_path=f"{prefix}(up|down)", rank=RANK, alpha=ALPHA)]


class Block(nn.Module):
  """The block in linen; `__call__(x, _)` so `nn.scan` can carry x."""

  up_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  down_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x, _=None):
    u = jnp.tanh(nn.Dense(F, use_bias=False, kernel_init=self.up_init, name="up")(x))
    z = nn.Einsum(
      (F, H, KH), "btf,fhk->bthk", use_bias=False, kernel_init=self.down_init, name="down"
    )(u)
    return x + z.reshape(x.shape), None


class Scan(nn.Module):
  """`length` blocks under `nn.scan` (params stacked on axis 0), each `nn.remat`ed if `remat`."""

  length: int
  remat: bool = True

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block) if self.remat else Block
    layers = nn.scan(
      block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.length
    )
    return layers(name="layers")(x, None)[0]


class NBlock(nnx.Module):
  """The block in nnx (nnx.Linear, nnx.Einsum)."""

  def __init__(self, rngs: nnx.Rngs, up_init=None, down_init=None):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(D, F, use_bias=False, kernel_init=up_init or init, rngs=rngs)
    self.down = nnx.Einsum("btf,fhk->bthk", (F, H, KH), kernel_init=down_init or init, rngs=rngs)

  def __call__(self, x):
    u = jnp.tanh(self.up(x))
    return x + self.down(u).reshape(x.shape)


class NScan(nnx.Module):
  """`length` NBlocks made by `nnx.vmap` and run by `nnx.scan` (each step `nnx.remat`ed if
  `remat`), `nnx.split_rngs` around it: each layer's adapter draws its own key."""

  def __init__(self, rngs: nnx.Rngs, length: int, remat: bool = True):
    self.length, self.remat = length, remat

    @nnx.split_rngs(splits=length)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NBlock(rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    def step(x, layer):
      return layer(x)

    if self.remat:
      step = nnx.remat(step)
    scan = nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    return nnx.split_rngs(splits=self.length)(scan)(x, self.layers)


def value(v) -> np.ndarray:
  """An nnx Variable's or a plain array's value as numpy."""
  return np.asarray(v[...] if isinstance(v, nnx.Variable) else v)


def matrix64(kernel) -> np.ndarray:
  """A Q8 param's served weight as the float64 (K, N) matrix (its padding rows cut; stacked
  layers keep their leading axis)."""
  q, scale = value(kernel.array.q), value(kernel.array.scale)
  k = kernel.how.layout.k
  if q.ndim == 2:
    return weight64(q, scale)[:k]
  return np.stack([weight64(qi, si)[:k] for qi, si in zip(q, scale, strict=True)])


def forward_backward64(
  x: np.ndarray, layers: list[dict[str, tuple]], c: np.ndarray
) -> tuple[np.ndarray, list[dict[str, tuple]], np.ndarray]:
  """The blocks in float64 and the gradients of sum(out * c).

  Args:
    x: (B, T, D).
    layers: per layer, 'up' and 'down' -> (W (K, N), A (K, r), B (r, N)), any float dtype.
    c: (B, T, D), the cotangent.

  Returns:
    (out (B, T, D); per layer 'up'/'down' -> (dA, dB); dx (B, T, D)).
  """
  f64 = [{k: tuple(np.asarray(t, np.float64) for t in v) for k, v in lay.items()} for lay in layers]
  h = np.asarray(x, np.float64).reshape(-1, D)
  saved = []
  for lay in f64:
    eff = {k: w + SCALE * a @ b for k, (w, a, b) in lay.items()}
    u = np.tanh(h @ eff["up"])
    saved.append((h, u, eff))
    h = h + u @ eff["down"]
  out = h
  dh = np.asarray(c, np.float64).reshape(-1, D)
  grads: list[dict[str, tuple]] = []
  for lay, (h_in, u, eff) in zip(reversed(f64), reversed(saved), strict=True):
    _, a_dn, b_dn = lay["down"]
    _, a_up, b_up = lay["up"]
    d_down = (SCALE * u.T @ (dh @ b_dn.T), SCALE * (u @ a_dn).T @ dh)
    dpre = (dh @ eff["down"].T) * (1 - u**2)
    d_up = (SCALE * h_in.T @ (dpre @ b_up.T), SCALE * (h_in @ a_up).T @ dpre)
    grads.append({"up": d_up, "down": d_down})
    dh = dh + dpre @ eff["up"].T
  grads.reverse()
  return out.reshape(x.shape), grads, dh.reshape(x.shape)


def random_adapters(rng: np.random.Generator, lead: tuple[int, ...] = ()) -> dict[str, tuple]:
  """Fresh float32 A (*lead, K, r), B (*lead, r, N) for 'up' (K=D, N=F) and 'down' (K=F, N=D),
  scaled so each delta is about as large as its base product."""
  shapes = {"up": (D, F), "down": (F, D)}
  out = {}
  for name, (k, n) in shapes.items():
    a = rng.standard_normal((*lead, k, RANK)) / np.sqrt(k)
    b = rng.standard_normal((*lead, RANK, n)) / np.sqrt(RANK) / SCALE
    out[name] = (jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  return out


def key_of(rng: np.random.Generator) -> jax.Array:
  """A fresh jax key drawn from `rng`."""
  return jax.random.key(int(rng.integers(2**31)))
