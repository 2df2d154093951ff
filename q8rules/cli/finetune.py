"""`q8rules finetune MODEL.gguf --text FILE --out adapter.gguf`: LoRA on a GGUF model, evaluated on
text it does not train on.

The model's Q8_0 weights stay frozen (requantized from other types at load, as `run` loads
them); LoRA adapters of `--rank` on the `--targets` (GGUF tensor kinds, default all seven block
matrices) train with AdamW (`q8rules.lora.trainer.LoraTrainer`). The data: `--text`, a plain
text file (random windows of `--length` tokens), or `--chat`, a JSON-lines file of conversations
({"messages": [{"role": ..., "content": ...}, ...]} per line) rendered through the file's own
chat template, only the assistant replies counted in the loss.

Part of the data is held out and never trained on: `--eval-split` of the text (windows spread
over it) or of the conversations (whole ones), or `--eval-text FILE` instead. Before training
the command prints the token count and the epochs the steps make of it; the eval loss and
perplexity follow before the first step, every `--eval-every` steps and after the last, beside
the training loss, with a warning when the eval loss rose at two evaluations in a row. With
`--save-best` (the default) the adapter written is the one of the lowest eval loss, and the
command names its step. The last line: eval perplexity before -> after.

The adapter is written as a llama.cpp LoRA file (`--out`: `llama-cli -m MODEL.gguf --lora
adapter.gguf`, or `q8rules run MODEL.gguf --lora adapter.gguf`); `--merged OUT.gguf` also writes
the model with the adapter merged (requantized to Q8_0). Both paths are checked before the model
loads. Progress bars show on a terminal only; a log file gets one line per phase.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from q8rules.cli import errors as E
from q8rules.cli.progress import bar, bars, say
from q8rules.cli.threads import add_threads

NAME = "finetune"
HELP = "train LoRA adapters on a GGUF model and write them for llama.cpp"
EXAMPLE = "q8rules finetune model.gguf --text notes.txt --out adapter.gguf"

LR = 1e-3
"""--lr's default: docs/lora.md says how it was chosen (with --steps' two epochs)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("model", help="a .gguf file (or the first part of a split set)")
  data = p.add_mutually_exclusive_group(required=True)
  data.add_argument("--text", help="a plain text file to train on (None: --chat)")
  data.add_argument("--chat", help="a JSON-lines file of conversations, rendered by the model's"
                    " chat template (None: --text)")  # fmt: skip
  p.add_argument(
    "--out", required=True, default=argparse.SUPPRESS,
    help="the adapter file to write (llama.cpp's format)",
  )  # fmt: skip
  p.add_argument("--merged", default=None,
                 help="also write the merged model here (.gguf; None: not written)")  # fmt: skip
  add_threads(p)
  p.add_argument("--no-progress", action="store_true",
                 help="no progress bars (they show only on a terminal anyway)")  # fmt: skip
  p.add_argument("-s", "--seed", type=int, default=0, help="the data's and adapters' seed")
  p.add_argument("--rank", type=E.positive_int, default=16, help="the adapters' rank")
  p.add_argument("--alpha", type=E.positive_float, default=32.0,
                 help="the adapters' alpha: their product is scaled by alpha / rank")  # fmt: skip
  p.add_argument("--targets", default=None,
                 help="comma-separated GGUF tensor kinds (None: attn_q,attn_k,attn_v,"
                 "attn_output,ffn_gate,ffn_up,ffn_down)")  # fmt: skip
  p.add_argument("--steps", type=E.positive_int, default=None,
                 help="optimizer steps (None: two epochs of the training data, which the"
                 " command prints before it starts)")  # fmt: skip
  p.add_argument("--batch", type=E.positive_int, default=4, help="sequences per step")
  p.add_argument("--length", type=E.positive_int, default=128, help="tokens per sequence")
  p.add_argument("--lr", type=E.positive_float, default=LR, help="AdamW's learning rate")
  p.add_argument("--eval-split", type=E.half_unit, default=0.1,
                 help="the part of the text (or of the conversations) held out for evaluation,"
                 " never trained on; 0: no evaluation")  # fmt: skip
  p.add_argument("--eval-text", default=None, metavar="FILE",
                 help="evaluate on this plain text instead of a part of the data"
                 " (None: --eval-split)")  # fmt: skip
  p.add_argument("--eval-every", type=E.positive_int, default=None,
                 help="evaluate every k steps, and before the first and after the last (None:"
                 " a tenth of the steps)")  # fmt: skip
  p.add_argument("--save-best", action=argparse.BooleanOptionalAction, default=True,
                 help="write the adapter of the lowest eval loss, not the last step's")  # fmt: skip
  p.add_argument("--log-every", type=E.positive_int, default=10,
                 help="print the training loss every k steps")  # fmt: skip


def check_writable(path: str | None, flag: str) -> None:
  """UsageError unless a file can be written at `path` (its folder exists and takes files; it is
  not a folder): checked before the model loads, so a bad path costs no training."""
  if path is None:
    return
  p = Path(path)
  folder = p.parent if str(p.parent) else Path(".")
  if p.is_dir():
    raise E.UsageError(f"{flag} {path}: a directory, not a file")
  if not folder.is_dir():
    raise E.UsageError(f"{flag} {path}: the folder {folder} does not exist")
  if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
    raise E.UsageError(f"{flag} {path}: not writable")


def execute(args: argparse.Namespace) -> dict:
  """Train and write the adapter; returns the losses, the evaluations and the paths written."""
  check_writable(args.out, "--out")
  check_writable(args.merged, "--merged")
  import jax.numpy as jnp
  import optax

  from q8rules.cli.finetune_data import data_of
  from q8rules.llm import compile_cache
  from q8rules.llm.load import load_gguf
  from q8rules.lora.trainer import LoraTrainer

  compile_cache.enable()
  m = load_gguf(args.model, dtype=jnp.float32, progress=bars(args.no_progress))
  targets = args.targets.split(",") if args.targets else None
  m = m.with_lora(rank=args.rank, alpha=args.alpha, targets=targets, seed=args.seed)
  data = data_of(m, args)
  trainer = LoraTrainer(m, optax.adamw(args.lr), seed=args.seed)
  say(f"{args.model}: LoRA rank {args.rank}, alpha {args.alpha} on {', '.join(m.lora.targets)}")
  for line in data.plan:
    say(line)
  result = train(trainer, data, args)
  return dict(losses=result.losses, evals=result.history.evals, **write(trainer, result, args))


def train(trainer, data, args: argparse.Namespace):
  """`fit` with its lines: the training loss every --log-every steps, the evaluations beside it,
  the overfitting warning, the training rate; the bar on a terminal. Returns the FitResult."""
  steps, every = data.steps, data.eval_every
  evaluated = bool(data.eval_batches)
  losses: list[float] = []
  times = [time.perf_counter()]
  warned = False
  progress = bar(steps, args.no_progress, desc="finetune", unit="step")

  def train_line(step: int) -> str:
    recent = losses[-args.log_every :]
    return f"step {step}: train loss {sum(recent) / len(recent):.4f} (mean of {len(recent)} steps)"

  def on_step(step: int, loss: float) -> None:
    times.append(time.perf_counter())
    losses.append(loss)
    progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
    progress.update(1)
    evaluates = evaluated and (step % every == 0 or step == steps)
    if not evaluates and (step % args.log_every == 0 or step == steps):
      say(train_line(step))

  def on_eval(e, history) -> None:
    nonlocal warned
    best = " (best so far)" if e is history.best and e.step else ""
    head = train_line(e.step) + "; " if e.step else "before training: "
    say(f"{head}eval loss {e.loss:.4f}, perplexity {e.perplexity:.2f}{best}")
    if history.rising and not warned:
      warned = True
      say(history.warning())
    times[-1] = time.perf_counter()  # the next step's time starts after the evaluation

  result = trainer.fit(
    trainer.init(),
    data.draw,
    steps,
    eval_batches=data.eval_batches,
    eval_every=every,
    keep_best=args.save_best,
    on_step=on_step,
    on_eval=on_eval,
  )
  progress.close()
  step_s = [b - a for a, b in zip(times, times[1:], strict=False)]
  tokens = args.batch * data.length
  warm = step_s[1:] or step_s
  say(
    f"training: {steps * tokens:,} training tokens in {sum(step_s):.1f} s;"
    f" {tokens * len(warm) / sum(warm):.1f} training tokens/s"
    + (" after the first step (its compilation)" if step_s[1:] else " (with its compilation)")
    + ("; evaluations not counted" if evaluated else "")
  )
  return result


def write(trainer, result, args: argparse.Namespace) -> dict:
  """Write the adapter (the best one with --save-best) and --merged; say which step it is and
  the eval perplexity before -> after."""
  best, history = result.history.best, result.history
  chosen = trainer.model(result.best_state)
  out = chosen.save_lora_gguf(args.out)
  step = result.best_state.step
  which = f"step {step}" + (
    ", the lowest eval loss" if args.save_best and best is not None else ", the last"
  )
  if args.save_best and best is not None and best.step == 0:
    which += " (no step lowered the eval loss: the adapter is the untrained one, B = 0)"
  say(f"wrote {out}: the adapter of {which}")
  written = {"adapter": str(out), "adapter_step": step}
  if args.merged:
    written["merged"] = str(chosen.merged().save_gguf(args.merged, progress=bars(args.no_progress)))
    say(f"wrote {args.merged}: the model with that adapter merged")
  if history.evals:
    first = history.evals[0]
    after = next(e for e in history.evals if e.step == step)
    change = 100 * (after.perplexity / first.perplexity - 1)
    last = history.evals[-1]
    tail = f"; at the last step ({last.step}) {last.perplexity:.2f}" if last.step != step else ""
    say(
      f"eval perplexity {first.perplexity:.2f} before -> {after.perplexity:.2f} after"
      f" ({change:+.1f} %, the adapter written: step {step}){tail}"
    )
  return written
