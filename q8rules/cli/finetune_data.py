"""`finetune`'s data: the training batches of --text or --chat, the held-out batches of
--eval-split or --eval-text, and the lines that say, before training starts, how many tokens
there are and how many epochs the run will make of them."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from q8rules.cli import errors as E
from q8rules.llm.model import GGUFModel

EPOCHS = 2
"""--steps None: the steps that read the training data this many times (docs/lora.md: the
held-out perplexity of the real model on a real text was lowest after 2 to 3 epochs)."""

EVALUATIONS = 10
"""--eval-every None: this many evaluations over the run (and one before it)."""


@dataclasses.dataclass
class Data:
  """What `finetune` trains and evaluates on.

  Attributes:
    draw: () -> (tokens (batch, T) int32, mask (batch, T) bool), a training batch.
    eval_batches: the held-out (tokens, mask) batches, [] for none.
    plan: the lines that describe the data and the run, printed before it starts.
    length: tokens per training sequence (--length, or fewer where the text is shorter).
    steps: --steps, or the steps of `EPOCHS` epochs.
    eval_every: --eval-every, or the steps between `EVALUATIONS` evaluations.
  """

  draw: Callable[[], tuple[Any, Any]]
  eval_batches: list
  plan: list[str]
  length: int
  steps: int
  eval_every: int


def read_text(path: str, flag: str) -> str:
  """The text of `path`; a UsageError naming `flag` when it cannot be read or holds no text."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise E.UsageError(f"{flag} {path}: {e.strerror}") from None
  except UnicodeDecodeError as e:
    raise E.UsageError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  if not text.strip():
    raise E.UsageError(f"{flag} {path}: the file is empty, so there is no text to learn from")
  return text


def _unrepeated(rows: list, training: list, args: argparse.Namespace) -> tuple[list, str]:
  """The held-out `rows` as batches, their tokens that repeat the `training` streams verbatim
  left out of the loss (`heldout.without_repeats`; no batches when that is all of them), and a
  warning line when there were any ('' otherwise)."""
  from q8rules.lora import heldout

  rows, dropped = heldout.without_repeats(rows, training)
  batches = heldout.eval_batches(rows, args.batch, args.length)
  if not dropped:
    return batches, ""
  total = heldout.targets(batches) + dropped
  if total == dropped:
    return [], (
      f"warning: all {total:,} held-out tokens repeat the training text verbatim"
      f" ({heldout.GRAM} tokens in a row or more): no evaluation, which could only measure"
      " recall (--eval-text: a text training does not read)"
    )
  return batches, (
    f"warning: {dropped:,} of the {total:,} held-out tokens repeat the training text verbatim"
    f" ({heldout.GRAM} tokens in a row or more): left out of the evaluation, which would read"
    " them from memory and look better than it is"
  )


def _eval_text(m: GGUFModel, args: argparse.Namespace, training: list) -> tuple[list, str, str]:
  """The --eval-text batches, the line describing them and the repeats' warning ('' for none):
  tokens that repeat the `training` streams verbatim are left out."""
  from q8rules.lora import heldout

  ids = m.tokenizer.encode(read_text(args.eval_text, "--eval-text"))
  spans = heldout.windows_of(ids, args.length)
  if not spans:
    raise E.UsageError(f"--eval-text {args.eval_text}: {len(ids)} token(s), fewer than 2")
  batches, warning = _unrepeated(heldout.text_rows(ids, spans), training, args)
  said = f"evaluated on --eval-text {args.eval_text}: {heldout.targets(batches):,} tokens"
  return batches, said, warning


def _schedule(
  args: argparse.Namespace, length: int, per_step: float, size: float, unit: str
) -> tuple[int, int, str]:
  """(steps, eval_every, the line that says them): --steps (None: `EPOCHS` epochs) of
  `per_step` units of the training data's `size`, and --eval-every (None: a tenth of them)."""
  steps = args.steps or max(1, math.ceil(EPOCHS * size / per_step))
  every = args.eval_every or max(1, round(steps / EVALUATIONS))
  why = "" if args.steps else f" (no --steps: the fewest whole steps that make {EPOCHS} epochs)"
  line = (
    f"{steps} steps of {args.batch} x {length} tokens{why} make {steps * per_step / size:.1f}"
    f" epochs of the training {unit} (one epoch: {size / per_step:.1f} steps); evaluated every"
    f" {every} steps"
  )
  return steps, every, line


def text_data(m: GGUFModel, args: argparse.Namespace) -> Data:
  """--text: random windows of the text, clear of the held-out windows."""
  from q8rules.lora import datasets, heldout

  ids = m.tokenizer.encode(read_text(args.text, "--text"))
  n = len(ids)
  if args.eval_text is not None:
    spans, (batches, said, warning) = [], _eval_text(m, args, [ids])
  else:
    try:
      spans = heldout.held_out_spans(n, args.eval_split, args.length)
    except ValueError as e:
      raise E.UsageError(f"--text {args.text}: {e} (--eval-split 0: no evaluation)") from None
    batches, warning = [], ""
    if spans:
      rows = heldout.text_rows(ids, spans)
      batches, warning = _unrepeated(rows, heldout.training_streams(ids, spans), args)
    held = sum(b - a for a, b in spans)
    said = (
      f"{held:,} held out for evaluation ({len(spans)} window(s) of {spans[0][1] - spans[0][0]}"
      " tokens spread over the text, never trained on)"
      if spans
      else "no evaluation (--eval-split 0)"
    )
  length = min(args.length, heldout.longest_gap(n, spans))
  if length < 2:
    raise E.UsageError(f"--text {args.text}: {n} token(s), too few to train on")
  train = n - sum(b - a for a, b in spans)
  draw = datasets.text_windows(ids, length, args.batch, seed=args.seed, exclude=spans)
  steps, every, line = _schedule(args, length, args.batch * length, train, "text")
  plan = [f"{args.text}: {n:,} tokens: {train:,} to train on; {said}", line]
  return Data(draw, batches, plan + ([warning] if warning else []), length, steps, every)


def chat_data(m: GGUFModel, args: argparse.Namespace) -> Data:
  """--chat: conversations at random, whole conversations held out (not checked for repeats:
  every conversation repeats its chat template's tokens by design; an --eval-text is checked
  against the training conversations)."""
  from q8rules.lora import datasets, heldout

  try:
    conversations = datasets.read_conversations(args.chat)
  except OSError as e:
    raise E.UsageError(f"--chat {args.chat}: {e.strerror}") from None
  except ValueError as e:
    raise E.UsageError(str(e)) from None
  warning = ""
  if args.eval_text is not None:
    train = conversations
    read = [datasets.conversation_ids(m, c)[0] for c in train]
    batches, said, warning = _eval_text(m, args, read)
  else:
    train, held = heldout.split_items(conversations, args.eval_split)
    rows = [datasets.conversation_ids(m, c) for c in held]
    rows = [(ids[: args.length], mask[: args.length]) for ids, mask in rows]
    batches = heldout.eval_batches(rows, args.batch, args.length) if rows else []
    said = (
      f"{len(held)} held out for evaluation ({heldout.targets(batches):,} reply tokens)"
      if held
      else "no evaluation (--eval-split 0, or a single conversation)"
    )
  draw = datasets.chat_batches(m, train, args.length, args.batch, seed=args.seed)
  steps, every, line = _schedule(args, args.length, args.batch, len(train), "conversations")
  plan = [
    f"{args.chat}: {len(conversations)} conversations: {len(train)} to train on; {said}",
    line,
  ]
  return Data(draw, batches, plan + ([warning] if warning else []), args.length, steps, every)


def data_of(m: GGUFModel, args: argparse.Namespace) -> Data:
  """The data of --text or --chat, with its held-out part."""
  if m.tokenizer is None:
    raise E.ModelError(f"{args.model}: its tokenizer could not be built, so no text to train on")
  return text_data(m, args) if args.text is not None else chat_data(m, args)


__all__ = ["Data", "chat_data", "data_of", "read_text", "text_data"]
