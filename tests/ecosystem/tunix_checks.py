"""The checks of the Tunix matrix, shared by its tests and `scripts/ecosystem_table.py`.

Each takes a `Served` case (a Tunix model, its float logits and its Q8 model as
`qwix.quantize_model(model, q8rules.Q8Provider([q8rules.Q8Rule()]), *inputs)` made it) and
returns the numbers the tests hold to their targets and the table in docs/ecosystem.md prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import zlib
from collections.abc import Iterator
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

import q8rules
from tests._utils import rel_err
from tests.ecosystem import tunix_models as tm


@contextlib.contextmanager
def tunix_flags() -> Iterator[None]:
  """Flax as Tunix sets it on import (params with sharding annotations and no mesh are not
  sharded eagerly), restored afterwards so the rest of a test session keeps its own."""
  before = flax.config.flax_always_shard_variable
  flax.config.update("flax_always_shard_variable", False)
  try:
    yield
  finally:
    flax.config.update("flax_always_shard_variable", before)


def forward(model: nnx.Module, args: tuple[Any, ...]) -> jax.Array:
  return tm.logits(model, args)


jit_forward = nnx.jit(forward)


def state_bytes(model: nnx.Module) -> list[bytes]:
  """Every leaf of the model's state, as bytes (params, and anything else it holds)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(model))]


@dataclasses.dataclass
class Served:
  """One case of the matrix, quantized with the default rule."""

  case: tm.Case
  model: nnx.Module
  args: tuple[Any, ...]
  float_logits: jax.Array
  q8: nnx.Module
  provider: q8rules.Q8Provider

  @functools.cached_property
  def eager(self) -> jax.Array:
    return forward(self.q8, self.args)

  @functools.cached_property
  def jitted(self) -> jax.Array:
    return jit_forward(self.q8, self.args)


def serve(case: tm.Case, rules: list[q8rules.Q8Rule] | None = None) -> Served:
  """Build the case's model (fresh random params) and quantize it, as the README says."""
  rng = np.random.default_rng(zlib.crc32(case.id.encode()))
  model = tm.build(case, rng)
  args = tm.inputs()
  float_logits = jit_forward(model, args)
  provider = q8rules.Q8Provider(rules or [q8rules.Q8Rule()])
  q8 = qwix.quantize_model(model, provider, *args)
  return Served(case, model, args, float_logits, q8, provider)


def error(out: jax.Array, s: Served) -> float:
  return rel_err(out, s.float_logits)


def qwix_int8_error(s: Served) -> float | None:
  """Qwix's own int8 PTQ on the same model and inputs (eager), or None when Qwix cannot run it."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8")]
  try:
    int8 = qwix.quantize_model(s.model, qwix.PtqProvider(rules), *s.args)
    return error(forward(int8, s.args), s)
  except TypeError:  # Qwen's `jnp.astype(self.w.value, dtype)` on its WithAux (F2)
    return None


def tables_float_error(s: Served) -> float:
  """Q8_0 on what Qwix int8 quantizes: products only, embedding tables (and tied heads) float."""
  rules = [q8rules.Q8Rule(op_names=("dot_general", "einsum"))]
  q8 = qwix.quantize_model(s.model, q8rules.Q8Provider(rules), *s.args)
  return error(jit_forward(q8, s.args), s)


def float_jit_vs_eager(s: Served) -> float:
  """The float model's own difference between eager and jit (XLA fuses differently)."""
  return rel_err(forward(s.model, s.args), s.float_logits)


def quantize_params_bit_equal(s: Served) -> bool:
  converted = q8rules.quantize_params(nnx.state(s.model, nnx.Param), s.q8)
  init_time = nnx.to_pure_dict(nnx.state(s.q8, nnx.Param))
  got, want = jax.tree.leaves(converted), jax.tree.leaves(init_time)
  return len(got) == len(want) and all(
    np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, want, strict=True)
  )


@dataclasses.dataclass
class Qat:
  """QAT against serving: `eager_vs_served` is both models eagerly (op by op), `jit_vs_served`
  both under `nnx.jit` (QAT's forward from its `nnx.jit(nnx.value_and_grad)` step where the
  gradients are taken)."""

  eager_vs_served: float
  jit_vs_served: float
  grads_finite: bool
  grad_cosine_to_float: float


def qat(s: Served, with_grads: bool = True) -> Qat:
  """QAT on the same model: its forward pass eagerly and under `nnx.jit` against the served
  model's, and its gradient (`nnx.jit(nnx.value_and_grad)`, one compile for both) against the
  float model's."""
  model = qwix.quantize_model(s.model, q8rules.Q8QatProvider([q8rules.Q8Rule()]), *s.args)
  eager = rel_err(forward(model, s.args), s.eager)
  if not with_grads:
    return Qat(eager, rel_err(jit_forward(model, s.args), s.jitted), True, float("nan"))

  def loss(m: nnx.Module) -> tuple[jax.Array, jax.Array]:
    logits = forward(m, s.args)
    return jnp.mean(logits.astype(jnp.float32) ** 2), logits

  def flat(g: Any) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)])

  step = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  (_, out), g = step(model)
  (_, _), g_float = step(s.model)
  g, g_float = flat(g), flat(g_float)
  cosine = float(g @ g_float / np.linalg.norm(g) / np.linalg.norm(g_float))
  return Qat(eager, rel_err(out, s.jitted), bool(np.isfinite(g).all()), cosine)


__all__ = [
  "Qat",
  "Served",
  "error",
  "float_jit_vs_eager",
  "forward",
  "jit_forward",
  "qat",
  "quantize_params_bit_equal",
  "qwix_int8_error",
  "serve",
  "state_bytes",
  "tables_float_error",
  "tunix_flags",
]
