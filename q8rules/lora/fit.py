"""The fine-tuning loop with a held-out evaluation: the eval loss before training, every
`eval_every` steps and at the end; a warning when it rose at two evaluations in a row (the
adapter has begun to learn the training text by heart); the adapters of the best evaluation
kept aside.

    result = fit(trainer, trainer.init(), draw, 100, eval_batches=held, eval_every=10)
    result.history.best            # Evaluation(step=30, loss=2.41): the lowest eval loss
    m = trainer.model(result.best_state)   # the model with that step's adapters
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

Batch = tuple[Any, Any]


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The mean next-token loss (nats, float) over every held-out target token, after `step`
  optimizer steps (0: before training)."""

  step: int
  loss: float

  @property
  def perplexity(self) -> float:
    """exp(loss): the held-out perplexity."""
    return math.exp(self.loss)


@dataclasses.dataclass
class EvalHistory:
  """The evaluations of one run, in step order."""

  evals: list[Evaluation] = dataclasses.field(default_factory=list)

  def add(self, step: int, loss: float) -> Evaluation:
    self.evals.append(Evaluation(step, float(loss)))
    return self.evals[-1]

  @property
  def best(self) -> Evaluation | None:
    """The evaluation with the lowest loss (the earliest of equal ones); None before any."""
    return min(self.evals, key=lambda e: e.loss, default=None)

  @property
  def rising(self) -> bool:
    """The eval loss rose at each of the last two evaluations."""
    e = self.evals
    return len(e) >= 3 and e[-3].loss < e[-2].loss < e[-1].loss

  def warning(self) -> str:
    """What a rise at two evaluations in a row means, naming the steps and the best one."""
    a, b, c = self.evals[-3:]
    best = self.best
    return (
      f"warning: the eval loss rose at two evaluations in a row ({a.loss:.4f} at step {a.step},"
      f" {b.loss:.4f} at step {b.step}, {c.loss:.4f} at step {c.step}): the adapter is learning"
      f" the training text by heart; the best so far is step {best.step} (eval perplexity"
      f" {best.perplexity:.2f}). Fewer steps or a lower learning rate stop before the rise."
    )


@dataclasses.dataclass
class FitResult:
  """What `fit` leaves: the last state, the training losses (one per step), the evaluations,
  and the state whose adapters had the lowest eval loss (`best_state`, for `trainer.model`: its
  optimizer state is None; the last state when nothing was evaluated or `keep_best` was off)."""

  state: Any
  losses: list[float]
  history: EvalHistory
  best_state: Any


def evaluate(trainer: Any, state: Any, batches: Sequence[Batch]) -> float:
  """The mean next-token loss of `state`'s adapters over every target token of `batches`
  ((tokens (B, T), mask (B, T)) each, `q8rules.lora.heldout.eval_batches`): each batch's mean
  weighted by its target count."""
  total, count = 0.0, 0
  for tokens, mask in batches:
    n = int(jnp.sum(jnp.asarray(mask)[:, 1:]))
    if n:
      total += float(trainer.loss(state, tokens, mask)) * n
      count += n
  if not count:
    raise ValueError("the held-out batches have no target token")
  return total / count


def fit(
  trainer: Any,
  state: Any,
  draw: Callable[[], Batch],
  steps: int,
  *,
  eval_batches: Sequence[Batch] | None = None,
  eval_every: int = 10,
  keep_best: bool = True,
  on_step: Callable[[int, float], None] | None = None,
  on_eval: Callable[[Evaluation, EvalHistory], None] | None = None,
) -> FitResult:
  """`steps` steps of `trainer` (a `LoraTrainer`) on batches of `draw()`, evaluated on
  `eval_batches` before the first step, after every `eval_every` steps and after the last.

  `on_step(step, loss)` follows each step (step counted from 1, the batch's loss before the
  update); `on_eval(evaluation, history)` each evaluation. With `keep_best`, the adapters of the
  lowest eval loss so far are copied aside (they are small: rank x (K + N) per matrix).
  """
  history, losses = EvalHistory(), []
  best_state = state

  def check(step: int) -> None:
    nonlocal best_state
    e = history.add(step, evaluate(trainer, state, eval_batches))
    if keep_best and e is history.best:
      best_state = state._replace(adapters=jax.tree.map(jnp.copy, state.adapters), opt_state=None)
    if on_eval is not None:
      on_eval(e, history)

  if eval_batches:
    check(0)
  for step in range(1, steps + 1):
    state, loss = trainer.step(state, *draw())
    losses.append(float(loss))
    if on_step is not None:
      on_step(step, losses[-1])
    if eval_batches and (step % eval_every == 0 or step == steps):
      check(step)
  if not (keep_best and eval_batches):
    best_state = state
  return FitResult(state, losses, history, best_state)


__all__ = ["EvalHistory", "Evaluation", "FitResult", "evaluate", "fit"]
