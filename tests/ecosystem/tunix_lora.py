"""Tunix's QLoRA recipe with a Q8_0 base: what tests/ecosystem/test_tunix_lora.py runs and checks.

Tunix adapts a model with `qwix.apply_lora_to_model(model, qwix.LoraProvider(module_path=...,
rank=16, alpha=2.0, weight_qtype='nf4'), **model.get_model_input())` and trains it with its
`PeftTrainer`. Here the provider is `q8rules.Q8LoraProvider` with the same module_path, rank
and alpha; the rest is Tunix's, unmodified.

The float64 reference (`Float64Twin`) is the same Tunix class built with float64 params
(`param_dtype`, and `dtype` where the config has one) run under `jax.enable_x64`, every weight
the Q8 model stores set to its Q8_0 values (`q * scale`, exactly, in float64) and every adapted
weight to those plus `A @ B * alpha / rank` laid back into the weight's own shape: the adapted
product `x @ W_q8 + x @ A @ B * s` is `x @ (W_q8 + A @ B * s)`, so its gradients in A and B
are the float64 model's, by the chain rule through the sum.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx

import q8rules
from q8rules.layout import WeightLayout
from q8rules.lora.provider import LORA_A, LORA_B
from q8rules.providers.q8_weight import Q8Weight
from tests.ecosystem import tunix_models as tm

RANK, ALPHA = 16, 2.0
"""Tunix's QLoRA demo's rank and alpha."""

MODULE_PATH = {
  "gemma3": ".*q_einsum|.*kv_einsum|.*gate_proj|.*down_proj|.*up_proj",
  "qwen3": ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj",
}
"""The module_path Tunix's LoRA recipes give `qwix.LoraProvider`: its QLoRA demo's for Gemma
(the q and kv einsums and the MLP; `attn_vec_einsum` left without an adapter) and its Llama /
Qwen recipes' (every attention and MLP projection)."""

ADAPTED_PER_LAYER = {"gemma3": 5, "qwen3": 7}
"""The products `MODULE_PATH` names in one decoder layer of each model."""

Path = tuple[str | int, ...]


def provider(name: str, base: str = "q8") -> q8rules.Q8LoraProvider:
  """The adapters' provider for model `name`.

  Args:
    name: 'gemma3' or 'qwen3'.
    base: 'q8': adapters where Tunix puts them and every other weight of the model (embedding
      table and tied head included) served as Q8_0 too; 'matched': Tunix's call as it is
      written, `Q8LoraProvider(module_path=..., rank=..., alpha=...)`, which (as Qwix's QLoRA
      with `weight_qtype`) stores only the adapted weights as Q8_0 and leaves the rest float.
  """
  if base == "matched":
    return q8rules.Q8LoraProvider(module_path=MODULE_PATH[name], rank=RANK, alpha=ALPHA)
  return q8rules.Q8LoraProvider(
    [q8rules.Q8LoraRule(module_path=MODULE_PATH[name], rank=RANK, alpha=ALPHA), q8rules.Q8Rule()]
  )


def adapt(
  model: nnx.Module, name: str, base: str = "q8"
) -> tuple[nnx.Module, q8rules.Q8LoraProvider]:
  """Tunix's step, `qwix.apply_lora_to_model(model, provider, **model.get_model_input())`:
  the adapted model and its provider."""
  lora = provider(name, base)
  return qwix.apply_lora_to_model(model, lora, rngs=nnx.Rngs(0), **model.get_model_input()), lora


BATCH, LENGTH, PAD = 4, 16, 5
"""The training batch: 4 sequences of 16 tokens, the last 5 of the second one padding."""

LEARNING_RATE = 1e-2
"""`optax.adam`'s, for PeftTrainer."""


def peft() -> tuple[Any, Any]:
  """Tunix's `tunix.sft.peft_trainer` and `tunix.sft.utils` (imported when called: Tunix is
  not installed in the default run)."""
  from tunix.sft import peft_trainer
  from tunix.sft import utils as sft_utils

  return peft_trainer, sft_utils


def training_input(rng: np.random.Generator) -> Any:
  """One `peft_trainer.TrainingInput` (numpy, as Tunix's data pipelines give it): tokens
  (BATCH, LENGTH) int32 and the input mask (BATCH, LENGTH) bool (`PAD` padding positions)."""
  peft_trainer, _ = peft()
  tokens = rng.integers(0, tm.VOCAB, (BATCH, LENGTH)).astype(np.int32)
  mask = np.ones((BATCH, LENGTH), bool)
  mask[1, -PAD:] = False
  return peft_trainer.TrainingInput(input_tokens=tokens, input_mask=mask)


def model_inputs(x: Any) -> dict[str, jax.Array]:
  """Tunix's QLoRA demo's `gen_model_input_fn`: the loss's arguments from a TrainingInput,
  positions and the causal attention mask made from its input mask by Tunix's own helpers."""
  _, sft_utils = peft()
  mask = jnp.asarray(x.input_mask)
  return {
    "input_tokens": jnp.asarray(x.input_tokens),
    "input_mask": mask,
    "positions": sft_utils.build_positions_from_mask(mask),
    "attention_mask": sft_utils.make_causal_attn_mask(mask),
  }


def train(model: nnx.Module, batch: Any, steps: int) -> Any:
  """Tunix's `PeftTrainer` on `model` with `optax.adam(LEARNING_RATE)` and its default loss:
  `steps` steps on `batch` (the same one each step), evaluated on it before and after. Run it
  under `with mesh:` for sharded training (the mesh Tunix's trainer reads). Returns the trainer
  (its `metrics_logger` holds the losses)."""
  peft_trainer, _ = peft()
  config = peft_trainer.TrainingConfig(eval_every_n_steps=steps, max_steps=steps)
  trainer = peft_trainer.PeftTrainer(model, optax.adam(LEARNING_RATE), config)
  trainer.with_gen_model_input_fn(model_inputs)
  trainer.train([batch] * steps, eval_ds=[batch])
  return trainer


def losses(trainer: Any, mode: str) -> np.ndarray:
  """The trainer's logged losses, `mode` 'train' (one a step) or 'eval' (one an evaluation)."""
  return np.asarray(trainer.metrics_logger.get_metric_history("", "loss", mode))


def leaf_bytes(state: nnx.State) -> list[bytes]:
  """Every leaf of `state` as bytes (a sharded array gathered whole)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]


def at(node: Any, path: Path) -> Any:
  """The attribute (or list item) of `node` at `path`."""
  for key in path:
    node = node[key] if isinstance(key, int) else getattr(node, key)
  return node


def value(x: Any) -> Any:
  """A Variable's value (anything else as it is)."""
  return x.get_value() if isinstance(x, nnx.Variable) else x


def matched_modules(model: nnx.Module, module_path: str) -> set[str]:
  """The paths of the model's modules that hold a weight matrix (their own param of rank >= 2)
  and whose path `module_path` matches as Qwix matches it (`re.fullmatch` on 'a/0/b')."""
  found = set()
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    own = [v for v in vars(node).values() if isinstance(v, nnx.Param) and v.ndim >= 2]
    where = "/".join(map(str, path))
    if own and re.fullmatch(module_path, where):
      found.add(where)
  return found


def adapters(model: nnx.Module) -> dict[Path, tuple[nnx.LoRAParam, nnx.LoRAParam]]:
  """weight path -> (A, B), the `<param>_lora_a` / `<param>_lora_b` beside it."""
  found: dict[Path, list[Any]] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.LoRAParam):
      for i, suffix in enumerate((LORA_A, LORA_B)):
        if isinstance(path[-1], str) and path[-1].endswith(suffix):
          weight = (*path[:-1], path[-1][: -len(suffix)])
          found.setdefault(weight, [None, None])[i] = node
  return {p: (a, b) for p, (a, b) in found.items()}


def q8_weights(model: nnx.Module) -> dict[Path, Q8Weight]:
  """path -> every param the model stores as Q8_0."""
  return {p: n for p, n in nnx.iter_graph(model) if isinstance(n, Q8Weight)}


def randomize_adapters(model: nnx.Module, rng: np.random.Generator) -> None:
  """Fresh normal A (std 1/sqrt(K)) and B (std 4/sqrt(rank)): the delta A @ B * alpha / rank
  is about half the size of an entry of a weight (`tm.randomize`: std 1/sqrt(fan-in))."""
  for a, b in adapters(model).values():
    a.set_value(jnp.asarray(rng.standard_normal(a.shape) / np.sqrt(a.shape[-2]), jnp.float32))
    b.set_value(jnp.asarray(4 * rng.standard_normal(b.shape) / np.sqrt(RANK), jnp.float32))


def native64(matrix: Any, layout: WeightLayout) -> np.ndarray:
  """The (K, N) matrix (rows past K dropped), or a stack of experts' (*E, K, N), back in the
  weight's own shape: K is the `layout.contract` axes flattened in order, N the `layout.free`
  axes, the experts the `layout.batch` axes."""
  order = layout.batch + layout.contract + layout.free
  moved = np.asarray(matrix, np.float64)[..., : layout.k, :]
  return np.transpose(moved.reshape([layout.shape[i] for i in order]), np.argsort(order))


def _native(matrix: jax.Array, layout: WeightLayout) -> jax.Array:
  """`native64` for a traced (K, N) matrix (or (*E, K, N) stack)."""
  order = layout.batch + layout.contract + layout.free
  moved = matrix.reshape([layout.shape[i] for i in order])
  return jnp.transpose(moved, np.argsort(order))


def dequantized64(q: Any, scale: Any) -> np.ndarray:
  """Q8_0 values (..., K_padded, N) and their scales (..., K_padded/32, N) in float64."""
  return np.asarray(q, np.float64) * np.repeat(np.asarray(scale, np.float64), 32, axis=-2)


@dataclasses.dataclass
class Float64Twin:
  """The float64 twin of an adapted Q8 model (see the module).

  Attributes:
    graphdef, state: `nnx.split` of the float64 model.
    base: float64 weight path -> value: the Q8_0 values of what the Q8 model stores as Q8_0,
      the float values of the rest (norm scales, float weights).
    layouts: adapted weight path -> its (K, N) layout.
  """

  graphdef: Any
  state: Any
  base: dict[Path, np.ndarray]
  layouts: dict[Path, WeightLayout]

  def module(self, ab: dict[Path, tuple[jax.Array, jax.Array]]) -> nnx.Module:
    """A copy of the float64 model with each adapted weight `base + A @ B * alpha / rank` (A, B
    float64, traceable: call under `jax.enable_x64`)."""
    model = nnx.merge(self.graphdef, jax.tree.map(lambda x: x, self.state))
    for path, w in self.base.items():
      w = jnp.asarray(w)
      if path in ab:
        a, b = ab[path]
        w = w + _native(a @ b * (ALPHA / RANK), self.layouts[path])
      at(model, path).set_value(w)
    return model


def float64_twin(q8_model: nnx.Module, float64_model: nnx.Module) -> Float64Twin:
  """The twin of `q8_model` on `float64_model` (the same Tunix class and sizes, float64 params,
  made under `jax.enable_x64`): its params at the same paths as the Q8 model's."""
  base, layouts = {}, {}
  lora = adapters(q8_model)
  for path, node in nnx.iter_graph(float64_model):
    if not isinstance(node, nnx.Param):
      continue
    served = value(at(q8_model, path))
    if isinstance(served, Q8Weight):
      layout = served.how.layout
      base[path] = native64(dequantized64(served.array.q[...], served.array.scale[...]), layout)
      if path in lora:
        layouts[path] = layout
    else:
      base[path] = np.asarray(served, np.float64)
  graphdef, state = nnx.split(float64_model)
  return Float64Twin(graphdef, state, base, layouts)


def lora64(model: nnx.Module) -> dict[Path, tuple[jax.Array, jax.Array]]:
  """The adapters' values in float64 (call under `jax.enable_x64`)."""
  return {
    p: (jnp.asarray(value(a), jnp.float64), jnp.asarray(value(b), jnp.float64))
    for p, (a, b) in adapters(model).items()
  }


def grads_by_weight(grads: nnx.State) -> dict[Path, tuple[jax.Array, jax.Array]]:
  """`nnx.grad`'s LoRA gradients, as weight path -> (dA, dB)."""
  flat = {tuple(p): value(v) for p, v in grads.flat_state()}
  weights = {(*p[:-1], p[-1][: -len(LORA_A)]) for p in flat if p[-1].endswith(LORA_A)}
  return {w: (flat[(*w[:-1], w[-1] + LORA_A)], flat[(*w[:-1], w[-1] + LORA_B)]) for w in weights}


class DecoderLayerOnX(nnx.Module):
  """One of Tunix's decoder layers called on activations x (B, T, D): its own `__call__(x,
  positions, None, mask)`, the layer's new x returned (what the model's loop does with it).
  Qwix intercepts a model's top-level call only, so the layer is adapted inside this."""

  def __init__(self, layer: nnx.Module):
    self.layer = layer

  def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    return self.layer(x, positions, None, mask)[1]


def case(name: str, dtype: str = "float32") -> tm.Case:
  """The matrix's case of model `name` (Gemma 3's head is the tied table, Qwen 3's its own)."""
  return tm.Case(name, dtype, tied=name == "gemma3")


def build64(name: str) -> nnx.Module:
  """Model `name` with float64 params (call under `jax.enable_x64`; values set by the twin)."""
  return tm.build(case(name, "float64"), np.random.default_rng(0))


__all__ = [
  "ADAPTED_PER_LAYER",
  "ALPHA",
  "BATCH",
  "LEARNING_RATE",
  "LENGTH",
  "MODULE_PATH",
  "PAD",
  "RANK",
  "DecoderLayerOnX",
  "Float64Twin",
  "adapt",
  "adapters",
  "at",
  "build64",
  "case",
  "dequantized64",
  "float64_twin",
  "grads_by_weight",
  "leaf_bytes",
  "lora64",
  "losses",
  "matched_modules",
  "model_inputs",
  "native64",
  "peft",
  "provider",
  "q8_weights",
  "randomize_adapters",
  "train",
  "training_input",
  "value",
]
