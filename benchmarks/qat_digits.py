"""QAT on scikit-learn's digits: float vs Q8_0 post-training vs Q8_0 quantization-aware training.

An MLP 64 -> 128 -> 128 -> 10 (every Dense matched: K = 64, 128, 128, all
multiples of 32) on `sklearn.datasets.load_digits` (8x8 images, shipped with
scikit-learn, no download), 75/25 stratified split:

  float  trained with Adam;
  PTQ    its params converted with `q8rules.quantize_params` and served by the
         `Q8Provider` model;
  QAT    fine-tuned from the float params under `Q8QatProvider` (same rules),
         then converted the same way and served.

Also the median step time (jit-compiled train step: forward, backward, Adam) of
float training and QAT in the same run, interleaved.

    python benchmarks/qat_digits.py            # full run, writes benchmarks/RESULTS.md
    python benchmarks/qat_digits.py --no-write # print only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's q8rules, benchmarks
import q8rules  # noqa: E402
from benchmarks import results_md  # noqa: E402
from benchmarks.results_md import markers  # noqa: E402
from q8rules.layout import WeightLayout  # noqa: E402
from q8rules.providers.qat import fake_quant  # noqa: E402
from q8rules.timing import median_time, timed_call  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS.md")
START, END = markers("qat")
write_section = functools.partial(results_md.write_section, "qat")
RULES = (q8rules.Q8Rule(module_path="fc[0-9]"),)


class MLP(nn.Module):
  """64 -> 128 -> 128 -> 10 with ReLU; x float32 (B, 64) -> logits float32 (B, 10)."""

  hidden: int = 128
  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(nn.Dense(self.hidden, name="fc0")(x))
    x = jax.nn.relu(nn.Dense(self.hidden, name="fc1")(x))
    return nn.Dense(self.classes, name="fc2")(x)


@dataclasses.dataclass
class Data:
  """Digits as float32 (n, 64) in [0, 1] and int32 labels (n,)."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load(seed: int = 0) -> Data:
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  xtr, xte, ytr, yte = train_test_split(
    x, y.astype(np.int32), test_size=0.25, random_state=seed, stratify=y
  )
  return Data(xtr, ytr, xte, yte)


TX = optax.inject_hyperparams(optax.adam)
"""Adam with the learning rate in its state: one compiled step serves every lr."""


def make_step(apply: Callable[..., jax.Array]) -> Callable:
  """A jitted Adam step: (params, opt_state, x (B, 64), y (B,)) -> (params, opt_state, loss)."""
  tx = TX(learning_rate=0.0)

  def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def init_opt(params: Any, lr: float) -> Any:
  return TX(learning_rate=lr).init(params)


def train(
  step: Callable,
  params: Any,
  data: Data,
  *,
  epochs: int,
  lr: float,
  batch: int = 64,
  seed: int = 0,
) -> tuple[Any, list[float]]:
  """Adam on shuffled minibatches (last partial batch dropped); returns params and epoch losses."""
  opt_state = init_opt(params, lr)
  rng = np.random.default_rng(seed)
  n = len(data.x_train) // batch * batch
  losses = []
  for _ in range(epochs):
    order = rng.permutation(len(data.x_train))[:n].reshape(-1, batch)
    total = 0.0
    for idx in order:
      params, opt_state, loss = step(params, opt_state, data.x_train[idx], data.y_train[idx])
      total += float(loss)
    losses.append(total / len(order))
  return params, losses


def evaluate(
  apply: Callable[..., jax.Array], params: Any, data: Data
) -> tuple[float, float, np.ndarray]:
  """(test accuracy, test cross-entropy, logits float32 (n_test, 10)); `apply` jitted."""
  logits = apply({"params": params}, data.x_test)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, data.y_test).mean()
  acc = float((np.asarray(logits).argmax(-1) == data.y_test).mean())
  return acc, float(loss), np.asarray(logits)


def step_times(
  steps: dict[str, Callable], params: Any, lr: float, x: np.ndarray, y: np.ndarray, n: int
) -> dict[str, float]:
  """Median seconds per jitted step, the steps interleaved (same load, same batch)."""
  times: dict[str, list[float]] = {k: [] for k in steps}
  state = {k: (params, init_opt(params, lr)) for k in steps}
  for k, step in steps.items():  # compile outside the timing
    jax.block_until_ready(step(*state[k], x, y))
  for _ in range(n):
    for k, step in steps.items():
      (new_params, opt_state, _), seconds = timed_call(step, *state[k], x, y)
      times[k].append(seconds)
      state[k] = (new_params, opt_state)
  return {k: statistics.median(v) for k, v in times.items()}


def run(
  *,
  float_epochs: int = 40,
  qat_epochs: int = 5,
  float_lr: float = 2e-3,
  qat_lr: float = 2e-4,
  timing_steps: int = 200,
  timing_batches: tuple[int, ...] = (64, 1024),
  seed: int = 0,
) -> dict[str, Any]:
  """Train float, convert (PTQ), fine-tune with QAT, convert; accuracies and step times."""
  t0 = time.perf_counter()
  data = load(seed)
  model = MLP()
  x0 = jnp.asarray(data.x_train[:2])

  float_step, float_eval = make_step(model.apply), jax.jit(model.apply)
  float_params = jax.jit(model.init)(jax.random.key(seed), x0)["params"]
  float_params, float_losses = train(
    float_step, float_params, data, epochs=float_epochs, lr=float_lr, seed=seed
  )
  acc_float, loss_float, logits_float = evaluate(float_eval, float_params, data)

  serving = qwix.quantize_model(model, q8rules.Q8Provider(RULES))
  serving_eval = jax.jit(serving.apply)
  abstract = jax.eval_shape(serving.init, jax.random.key(seed), x0)["params"]
  # The conversion, compiled once (eager, each of the quantizer's ops compiles on its own).
  convert = jax.jit(lambda p: q8rules.quantize_params(p, abstract))
  ptq_params = convert(float_params)
  acc_ptq, loss_ptq, logits_ptq = evaluate(serving_eval, ptq_params, data)

  qat_provider = q8rules.Q8QatProvider(RULES)
  qat = qwix.quantize_model(model, qat_provider)
  qat_step = make_step(qat.apply)
  qat_params, qat_losses = train(
    qat_step, float_params, data, epochs=qat_epochs, lr=qat_lr, seed=seed + 1
  )
  acc_qat_fwd, loss_qat_fwd, logits_qat_fwd = evaluate(jax.jit(qat.apply), qat_params, data)
  served_params = convert(qat_params)
  acc_qat, loss_qat, logits_qat = evaluate(serving_eval, served_params, data)

  # Control: the same extra epochs in float, then PTQ (QAT's gain net of the extra training).
  more_params, _ = train(
    float_step, float_params, data, epochs=qat_epochs, lr=qat_lr, seed=seed + 1
  )
  acc_more, loss_more, _ = evaluate(float_eval, more_params, data)
  acc_more_ptq, loss_more_ptq, _ = evaluate(serving_eval, convert(more_params), data)
  train_seconds = time.perf_counter() - t0

  timing = {}
  rng = np.random.default_rng(seed)
  for batch in timing_batches:
    idx = rng.integers(0, len(data.x_train), batch)
    timing[batch] = step_times(
      {"float": float_step, "qat": qat_step},
      float_params,
      qat_lr,
      data.x_train[idx],
      data.y_train[idx],
      timing_steps,
    )

  # The fake quant of the three weights alone, and a trivial elementwise pass over them.
  kernels = [float_params[f"fc{i}"]["kernel"] for i in range(3)]
  layouts = [WeightLayout(tuple(w.shape), (0,), (1,)) for w in kernels]
  alone = {
    "fake_quant": jax.jit(
      lambda ws: [fake_quant(w, lay) for w, lay in zip(ws, layouts, strict=True)]
    ),
    "elementwise": jax.jit(lambda ws: [w * 1.0001 + 0.5 for w in ws]),
  }
  alone_seconds = {k: median_time(f, kernels, reps=timing_steps) for k, f in alone.items()}

  def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  return {
    "n_train": len(data.x_train),
    "n_test": len(data.x_test),
    "float_epochs": float_epochs,
    "qat_epochs": qat_epochs,
    "float_lr": float_lr,
    "qat_lr": qat_lr,
    "acc": {
      "float": acc_float,
      "ptq": acc_ptq,
      "qat": acc_qat,
      "qat_forward": acc_qat_fwd,
      "float_more": acc_more,
      "float_more_ptq": acc_more_ptq,
    },
    "loss": {
      "float": loss_float,
      "ptq": loss_ptq,
      "qat": loss_qat,
      "qat_forward": loss_qat_fwd,
      "float_more": loss_more,
      "float_more_ptq": loss_more_ptq,
    },
    "float_train_losses": float_losses,
    "qat_train_losses": qat_losses,
    "logit_rel_err_ptq_vs_float": rel(logits_ptq, logits_float),
    "logit_rel_err_served_vs_qat_forward": rel(logits_qat, logits_qat_fwd),
    "predictions_served_eq_qat_forward": bool(
      (logits_qat.argmax(-1) == logits_qat_fwd.argmax(-1)).all()
    ),
    "report": str(qat_provider.report()),
    "step_seconds": timing,
    "weights_alone_seconds": alone_seconds,
    "n_weight_values": int(sum(w.size for w in kernels)),
    "timing_steps": timing_steps,
    "train_seconds": train_seconds,
  }


def machine() -> str:
  devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
  return (
    f"{results_md.machine()}; jax {jax.__version__} on {jax.default_backend()}"
    f" ({devices}); python {platform.python_version()};"
    f" load average at the end: {results_md.load_average()}"
  )


def section(r: dict[str, Any], *, date: str, command: str, seconds: float) -> str:
  acc, loss = r["acc"], r["loss"]
  lines = [
    START,
    "## QAT on digits",
    "",
    f"- date: {date}",
    f"- machine: {machine()}",
    f"- command: `{command}` ({seconds:.0f} s in all)",
    f"- task: scikit-learn `load_digits`, {r['n_train']} train / {r['n_test']} test"
    " (stratified 75/25, seed 0); MLP 64 -> 128 -> 128 -> 10, ReLU; every Dense served"
    " as Q8_0 (`Q8Rule(module_path='fc[0-9]')`, float32 scales); Adam, batch 64.",
    f"- float: {r['float_epochs']} epochs at lr {r['float_lr']:g}. PTQ: `quantize_params` of"
    f" the float params. QAT: {r['qat_epochs']} epochs at lr {r['qat_lr']:g} from the float"
    " params under `Q8QatProvider`, then `quantize_params`. Accuracies of PTQ and QAT are"
    " of the *served* model (`Q8Provider`, Q8_0 weights).",
    "",
    "| model | test accuracy | test cross-entropy |",
    "|---|---|---|",
    f"| float | {acc['float']:.4f} | {loss['float']:.4f} |",
    f"| Q8_0 PTQ (served) | {acc['ptq']:.4f} | {loss['ptq']:.4f} |",
    f"| Q8_0 QAT (served) | {acc['qat']:.4f} | {loss['qat']:.4f} |",
    f"| Q8_0 QAT (training forward, fake quant) | {acc['qat_forward']:.4f} |"
    f" {loss['qat_forward']:.4f} |",
    f"| control: float + {r['qat_epochs']} epochs at the QAT lr | {acc['float_more']:.4f} |"
    f" {loss['float_more']:.4f} |",
    f"| control, Q8_0 PTQ (served) | {acc['float_more_ptq']:.4f} | {loss['float_more_ptq']:.4f} |",
    "",
    f"- PTQ logits vs float: relative error {r['logit_rel_err_ptq_vs_float']:.2e}.",
    f"- served QAT logits vs the QAT forward pass: relative error"
    f" {r['logit_rel_err_served_vs_qat_forward']:.2e}; same predictions:"
    f" {r['predictions_served_eq_qat_forward']}.",
    "",
    f"Train step time (jit-compiled forward + backward + Adam; median of {r['timing_steps']}"
    " steps, float and QAT interleaved in the same run):",
    "",
    "| batch | float | QAT (Q8_0 fake quant) | QAT / float |",
    "|---|---|---|---|",
  ]
  for batch, t in r["step_seconds"].items():
    lines.append(
      f"| {batch} | {t['float'] * 1e6:.0f} us | {t['qat'] * 1e6:.0f} us |"
      f" {t['qat'] / t['float']:.2f}x |"
    )
  n = r["n_test"]

  def examples(a: float, b: float) -> str:
    return f"{round((a - b) * n):+d}"

  t64 = r["step_seconds"].get(64)
  alone = r["weights_alone_seconds"]
  lines += [
    "",
    f"Accuracy, in test examples (of {n}): PTQ {examples(acc['ptq'], acc['float'])} vs float;"
    f" QAT {examples(acc['qat'], acc['ptq'])} vs PTQ and"
    f" {examples(acc['qat'], acc['float_more_ptq'])} vs the control's PTQ. Q8_0 (8 bits, one"
    f" absmax scale per 32 weights) moves the logits by {r['logit_rel_err_ptq_vs_float']:.1e}"
    " (relative), so on this task PTQ already keeps the float accuracy and QAT has nothing"
    " measurable to recover; what QAT does give is a trained model that is what is served"
    f" (served vs QAT forward logits: {r['logit_rel_err_served_vs_qat_forward']:.1e}).",
  ]
  if t64:
    others = "".join(
      f" and {(t['qat'] - t['float']) * 1e6:.0f} us at batch {b}"
      for b, t in r["step_seconds"].items()
      if b != 64
    )
    lines += [
      "",
      f"Step time: fake quant adds {(t64['qat'] - t64['float']) * 1e6:.0f} us per step at"
      f" batch 64{others} (medians on a shared machine, so a few tens of us are noise). Its"
      f" work depends on the weights ({r['n_weight_values']:,} values), not on the batch: per"
      " weight, XLA runs one"
      " reduction (the block amax) and one elementwise fusion writing the fake-quantised copy"
      " (two reads and one write of the weight); the backward pass does not touch the quantizer"
      " (straight-through). The quantizer is llama.cpp-exact, including an exact path for"
      " blocks below 2**-100, so it is arithmetic-heavy: the three weights' fake quant alone"
      f" takes {alone['fake_quant'] * 1e6:.0f} us compiled, a trivial elementwise pass over"
      f" them {alone['elementwise'] * 1e6:.0f} us (both include the call's dispatch).",
    ]
  lines += [
    END,
  ]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--no-write", action="store_true", help="print only")
  args = parser.parse_args(argv)
  t = time.perf_counter()
  r = run()
  seconds = time.perf_counter() - t
  date = subprocess.run(["date"], capture_output=True, text=True, check=False).stdout.strip()
  command = "python benchmarks/qat_digits.py" + (" --no-write" if args.no_write else "")
  text = section(r, date=date, command=command, seconds=seconds)
  print(r["report"])
  print(text)
  print(f"float train losses: {[round(v, 4) for v in r['float_train_losses']]}")
  print(f"QAT train losses:   {[round(v, 4) for v in r['qat_train_losses']]}")
  if not args.no_write:
    write_section(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
  sys.exit(main())
