"""Training a loaded GGUF model's LoRA adapters with optax: the loss and one jitted step.

    m = q8rules.load_gguf("model.gguf", dtype=jnp.float32).with_lora(rank=16, alpha=32.0)
    trainer = LoraTrainer(m, optax.adamw(1e-3))
    state = trainer.init()
    for tokens, mask in batches:                 # (B, T) int32, (B, T) bool or None
      state, loss = trainer.step(state, tokens, mask)
    m = trainer.model(state)                      # the GGUFModel with the trained adapters
    held_loss = trainer.evaluate(state, held)     # mean loss over held-out (tokens, mask) batches
    m.save_lora_gguf("adapter.gguf")              # for llama.cpp's --lora

`fit` runs that loop with the held-out evaluation (before, every few steps, at the end) and
keeps the adapters of the best one (`q8rules.lora.fit`).

Only the adapters are arguments of the gradient: the Q8_0 base goes into the step as a
separate, non-donated argument and comes out untouched (its bytes are the file's). The adapters
and the optimizer state are donated to the step, so each step updates them in place.

The loss is the mean next-token cross-entropy: position t predicts token t + 1, counted where
`mask[:, t + 1]` is set (all positions when mask is None), in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.lora.gguf_model import lora_model
from q8rules.lora.loaded import LoadedModel
from q8rules.models.attention import init_cache
from q8rules.providers import shard_products
from q8rules.sharding.adapters import LORA_A, LORA_B


def next_token_loss(logits: jax.Array, tokens: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Mean next-token cross-entropy.

  Args:
    logits: (B, T, V) float32, the model's output at every position.
    tokens: (B, T) int32, the input ids.
    mask: (B, T) bool or float, which tokens are targets (None: all).

  Returns:
    A float32 scalar: sum over targets t >= 1 of -log p(tokens[t] | tokens[:t]) / their count.
  """
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  weight = jnp.ones_like(nll) if mask is None else jnp.asarray(mask[:, 1:], jnp.float32)
  return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def split_adapters(params: Any) -> tuple[Any, Any]:
  """(base, adapters): `params` without its `<name>_lora_a` / `_lora_b` leaves, and those leaves
  alone, in the same nested dicts."""

  def walk(node: Any) -> tuple[Any, Any]:
    if not isinstance(node, dict):
      return node, None
    base, adapters = {}, {}
    for key, value in node.items():
      if isinstance(key, str) and key.endswith((LORA_A, LORA_B)):
        adapters[key] = value
        continue
      b, a = walk(value)
      base[key] = b
      if a:
        adapters[key] = a
    return base, adapters

  return walk(params)


def join_adapters(base: Any, adapters: Any) -> Any:
  """The inverse of `split_adapters`."""
  if not isinstance(adapters, dict):
    return base
  out = dict(base)
  for key, value in adapters.items():
    out[key] = join_adapters(base[key], value) if key in base else value
  return out


def _cache_for(config: Any, tokens: jax.Array) -> Any:
  return init_cache(config, tokens.shape[1], tokens.shape[0])


def model_loss(
  model: Any, config: Any, params: Any, tokens: jax.Array, mask: Any, rngs: Any = None
) -> jax.Array:
  """`next_token_loss` of `model` (a quantized `Transformer`) on tokens (B, T)."""
  kwargs = {} if rngs is None else {"rngs": rngs}
  logits, _ = model.apply({"params": params}, tokens, _cache_for(config, tokens), 0, **kwargs)
  return next_token_loss(logits, tokens, mask)


def check_batch(tokens: Any, mask: Any, vocab: int) -> tuple[jax.Array, jax.Array | None]:
  """tokens as (B, T) int32 (a 1-D sequence is one row) and mask as (B, T) float32 or None.

  Raises:
    ValueError: ids outside [0, vocab), fewer than 2 positions, a mask of another shape.
  """
  arr = np.asarray(tokens)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or arr.shape[1] < 2 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"tokens must be (B, T) ints with T >= 2, got shape {arr.shape} {arr.dtype}")
  if arr.min() < 0 or arr.max() >= vocab:
    raise ValueError(f"token ids must lie in [0, {vocab}), got {arr.min()}..{arr.max()}")
  if mask is None:
    return jnp.asarray(arr, jnp.int32), None
  m = np.asarray(mask)
  m = m[None] if m.ndim == 1 else m
  if m.shape != arr.shape:
    raise ValueError(f"mask of shape {m.shape} does not match tokens of shape {arr.shape}")
  return jnp.asarray(arr, jnp.int32), jnp.asarray(m, jnp.float32)


class TrainState(NamedTuple):
  """What `LoraTrainer.step` updates: the adapters (nested dicts of float32 arrays, as
  `split_adapters` gives them), the optimizer's state, the step count, the dropout key."""

  adapters: Any
  opt_state: Any
  step: int
  key: jax.Array


@dataclasses.dataclass
class LoraTrainer:
  """Train the adapters of a `GGUFModel.with_lora` model with an optax optimizer (see the module).

  Attributes:
    m: the adapted GGUFModel (its base and its initial adapters).
    optimizer: an `optax.GradientTransformation`.
    seed: the dropout key's seed (used when the adapters have dropout).
  """

  m: LoadedModel
  optimizer: Any
  seed: int = 0

  def __post_init__(self) -> None:
    if self.m.lora is None:
      raise ValueError(f"{self.m.path}: LoraTrainer needs a model with adapters (with_lora)")
    self.base, _ = split_adapters(self.m.params)
    spec = self.m.lora
    self._model = (
      lora_model(self.m.config, self.m.params, spec, dropout=spec.dropout)
      if spec.dropout
      else self.m.model
    )
    self._step = jax.jit(self._update, donate_argnums=(1, 2))
    self._loss = jax.jit(self._loss_of)

  def _context(self) -> Any:
    import contextlib

    if self.m.mesh is None:
      return contextlib.nullcontext()
    return shard_products(self.m.mesh, self.m.product_specs)

  def _loss_of(self, base: Any, adapters: Any, tokens: jax.Array, mask: Any, key: Any) -> Any:
    rngs = {"dropout": key} if self.m.lora.dropout else None
    return model_loss(self._model, self.m.config, join_adapters(base, adapters), tokens, mask, rngs)

  def _update(
    self, base: Any, adapters: Any, opt_state: Any, tokens: jax.Array, mask: Any, key: Any
  ) -> tuple[Any, Any, jax.Array]:
    import optax

    loss, grads = jax.value_and_grad(self._loss_of, argnums=1)(base, adapters, tokens, mask, key)
    updates, opt_state = self.optimizer.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, loss

  def init(self) -> TrainState:
    """The state at step 0: the model's adapters (copied: the model keeps its own) and the
    optimizer's initial state."""
    _, adapters = split_adapters(self.m.params)
    adapters = jax.tree.map(jnp.copy, adapters)
    return TrainState(adapters, self.optimizer.init(adapters), 0, jax.random.key(self.seed))

  def step(self, state: TrainState, tokens: Any, mask: Any = None) -> tuple[TrainState, jax.Array]:
    """One optimizer step on a batch: tokens (B, T) int (or (T,)), mask (B, T) or None.
    Returns the new state (the old one's arrays are donated) and the batch's loss before it."""
    tokens, mask = check_batch(tokens, mask, self.m.config.vocab)
    key, sub = jax.random.split(state.key)
    with self._context():
      adapters, opt_state, loss = self._step(
        self.base, state.adapters, state.opt_state, tokens, mask, sub
      )
    return TrainState(adapters, opt_state, state.step + 1, key), loss

  def loss(self, state: TrainState, tokens: Any, mask: Any = None) -> jax.Array:
    """The loss of the adapters of `state` on a batch (no dropout, no update)."""
    tokens, mask = check_batch(tokens, mask, self.m.config.vocab)
    spec = self.m.lora
    with self._context():
      if spec.dropout:  # evaluate the serving model: no dropout
        fn = jax.jit(
          lambda b, a, t, mk: model_loss(self.m.model, self.m.config, join_adapters(b, a), t, mk)
        )
        return fn(self.base, state.adapters, tokens, mask)
      return self._loss(self.base, state.adapters, tokens, mask, state.key)

  def evaluate(self, state: TrainState, batches: Any) -> float:
    """The mean loss of `state`'s adapters over every target token of `batches` ((tokens (B, T),
    mask (B, T)) each; `q8rules.lora.heldout.eval_batches` makes them from held-out text)."""
    from q8rules.lora.fit import evaluate

    return evaluate(self, state, batches)

  def fit(self, state: TrainState, draw: Any, steps: int, **kwargs: Any) -> Any:
    """`steps` steps on batches of `draw()`, evaluated on `eval_batches=` before, every
    `eval_every=` steps and at the end, the best adapters kept: `q8rules.lora.fit.fit`
    (its FitResult)."""
    from q8rules.lora.fit import fit

    return fit(self, state, draw, steps, **kwargs)

  def model(self, state: TrainState) -> Any:
    """The GGUFModel with the adapters of `state` (copied, so later steps cannot donate them)."""
    adapters = jax.tree.map(jnp.copy, state.adapters)
    return dataclasses.replace(self.m, params=join_adapters(self.base, adapters))


__all__ = [
  "LoraTrainer",
  "TrainState",
  "check_batch",
  "join_adapters",
  "model_loss",
  "next_token_loss",
  "split_adapters",
]
