"""Small, randomly initialised models of Tunix (`google-tunix`, `tunix.models`), as they ship.

Each case builds a Tunix model class from its own `ModelConfig` with small sizes (one layer,
every contracted axis a multiple of 32), then overwrites every param with fresh random values (Tunix
initialises the MLP kernels to zeros, which would quantize trivially); the model code is
Tunix's, untouched. Inputs are the model's own call signature: tokens, positions, no cache and
a causal mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB = 256
DIM = 64
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
LAYERS = 1


@dataclasses.dataclass(frozen=True)
class Case:
  """One model of the matrix.

  Attributes:
    name: 'llama3', 'qwen2', 'qwen3', 'gemma', 'gemma2' or 'gemma3'.
    dtype: 'float32' or 'bfloat16': the params' dtype (and the activations' where the
      model's config has a `dtype`).
    tied: the output head is the embedding table (`x @ E.T`).
  """

  name: str
  dtype: str
  tied: bool

  @property
  def id(self) -> str:
    return f"{self.name}-{self.dtype}"


CASES = tuple(
  Case(name, dtype, tied)
  for name, tied in (
    ("llama3", True),
    ("qwen2", True),
    ("qwen3", False),
    ("gemma", True),
    ("gemma2", True),
    ("gemma3", True),
  )
  for dtype in ("float32", "bfloat16")
)
"""Tied heads on Llama 3 and Qwen 2 (their `weight_tying` / `use_tied_embedding`), an untied
`lm_head` Einsum on Qwen 3; Gemma's head is always the embedding table."""


def _config(case: Case) -> Any:
  dtype = jnp.dtype(case.dtype)
  common = dict(
    num_layers=LAYERS,
    embed_dim=DIM,
    hidden_dim=HIDDEN,
    num_heads=HEADS,
    head_dim=HEAD_DIM,
    num_kv_heads=KV_HEADS,
  )
  if case.name == "llama3":
    from tunix.models.llama3 import model as m

    cfg = m.ModelConfig(
      **common, vocab_size=VOCAB, rope_theta=10_000, norm_eps=1e-6, weight_tying=case.tied
    )
    return m.Llama3, cfg
  if case.name in ("qwen2", "qwen3"):
    from tunix.models.qwen2 import model as q2
    from tunix.models.qwen3 import model as q3

    m, cls = (q2, q2.Qwen2) if case.name == "qwen2" else (q3, q3.Qwen3)
    cfg = m.ModelConfig(
      **common,
      vocab_size=VOCAB,
      rope_theta=10_000,
      norm_eps=1e-6,
      use_tied_embedding=case.tied,
      dtype=dtype,
      param_dtype=dtype,
    )
    return cls, cfg
  if case.name in ("gemma", "gemma2"):
    from tunix.models.gemma import model as m

    gemma2 = case.name == "gemma2"
    cfg = m.ModelConfig(
      **common,
      num_embed=VOCAB,
      final_logit_softcap=30.0 if gemma2 else None,
      use_post_attn_norm=gemma2,
      use_post_ffw_norm=gemma2,
      attention_types=(
        (m.AttentionType.LOCAL_SLIDING,) * LAYERS if gemma2 else (m.AttentionType.GLOBAL,) * LAYERS
      ),
      attn_logits_soft_cap=50.0 if gemma2 else None,
      sliding_window_size=4 if gemma2 else None,
    )
    return m.Gemma, cfg
  if case.name == "gemma3":
    from tunix.models.gemma3 import model as m

    cfg = m.ModelConfig(**common, num_embed=VOCAB, sliding_window_size=4, param_dtype=dtype)
    return m.Gemma3, cfg
  raise ValueError(f"unknown model {case.name!r}")


def randomize(model: nnx.Module, rng: np.random.Generator, dtype: Any) -> None:
  """Every param of `model` replaced by fresh normal values (std 1/sqrt(fan-in) for matrices,
  around 1 for norm scales) in `dtype`, in place."""
  state = nnx.state(model, nnx.Param)

  def fresh(x: jax.Array) -> jax.Array:
    if x.ndim <= 1:
      v = 1.0 + 0.1 * rng.standard_normal(x.shape)
    else:
      v = rng.standard_normal(x.shape) / np.sqrt(max(x.shape[0], 1))
    return jnp.asarray(v.astype(np.float32)).astype(dtype)

  nnx.update(model, jax.tree.map(fresh, state))


def build(case: Case, rng: np.random.Generator) -> nnx.Module:
  """The Tunix model of `case`, with fresh random params."""
  cls, cfg = _config(case)
  model = cls(cfg, rngs=nnx.Rngs(params=int(rng.integers(1 << 30))))
  randomize(model, rng, jnp.dtype(case.dtype))
  return model


def inputs(batch: int = 2, length: int = 8, seed: int = 0) -> tuple[Any, ...]:
  """(tokens (B, T) int32, positions (B, T), cache None, causal mask (B, T, T) bool)."""
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
  return tokens, positions, None, mask


def logits(model: Callable[..., Any], args: tuple[Any, ...]) -> jax.Array:
  """The model's logits (B, T, V) as float32 (Tunix models return (logits, cache))."""
  return jnp.asarray(model(*args)[0], jnp.float32)
