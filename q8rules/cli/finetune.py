"""`q8rules finetune MODEL.gguf --text FILE --steps N --out adapter.gguf`: LoRA on a GGUF model.

The model's Q8_0 weights stay frozen (requantized from other types at load, as `run` loads
them); LoRA adapters of `--rank` on the `--targets` (GGUF tensor kinds, default all seven block
matrices) train with AdamW (`q8rules.llm.finetune.LoraTrainer`). The data: `--text`, a plain
text file (random windows of `--length` tokens), or `--chat`, a JSON-lines file of conversations
({"messages": [{"role": ..., "content": ...}, ...]} per line) rendered through the file's own
chat template, only the assistant replies counted in the loss. A progress bar runs on stderr
and the loss is printed every `--log-every` steps. The adapter is written as a llama.cpp LoRA
file (`--out`: `llama-cli -m MODEL.gguf --lora adapter.gguf`, or `q8rules run MODEL.gguf --lora
adapter.gguf`); `--merged OUT.gguf` also writes the model with the adapter merged (requantized
to Q8_0).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from q8rules.cli import errors as E

NAME = "finetune"
HELP = "train LoRA adapters on a GGUF model and write them for llama.cpp"
EXAMPLE = "q8rules finetune model.gguf --text notes.txt --steps 100 --out adapter.gguf"


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("model", help="a .gguf file (or the first part of a split set)")
  data = p.add_mutually_exclusive_group(required=True)
  data.add_argument("--text", help="a plain text file to train on")
  data.add_argument("--chat", help="a JSON-lines file of conversations (the file's template)")
  p.add_argument("--out", required=True, help="the adapter file to write (llama.cpp's format)")
  p.add_argument("--merged", default=None, help="also write the merged model here (.gguf)")
  p.add_argument("--rank", type=E.positive_int, default=16)
  p.add_argument("--alpha", type=E.positive_float, default=32.0)
  p.add_argument("--targets", default=None,
                 help="comma-separated GGUF tensor kinds (default: attn_q,attn_k,attn_v,"
                 "attn_output,ffn_gate,ffn_up,ffn_down)")  # fmt: skip
  p.add_argument("--steps", type=E.positive_int, default=100)
  p.add_argument("--batch", type=E.positive_int, default=4)
  p.add_argument("--length", type=E.positive_int, default=128, help="tokens per sequence")
  p.add_argument("--lr", type=E.positive_float, default=1e-3, help="AdamW's learning rate")
  p.add_argument("--log-every", type=E.positive_int, default=10, help="print the loss every k")
  p.add_argument("-s", "--seed", type=int, default=0)
  p.add_argument("-t", "--threads", type=E.positive_int, default=None, help="CPUs to run on")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")


def batches_of(m: Any, args: argparse.Namespace) -> Any:
  """The batch sampler of --text or --chat."""
  from q8rules.llm import datasets

  if m.tokenizer is None:
    raise E.ModelError(f"{args.model}: its tokenizer could not be built, so no text to train on")
  if args.text is not None:
    try:
      text = open(args.text, encoding="utf-8").read()
    except OSError as e:
      raise E.UsageError(f"--text {args.text}: {e.strerror}") from None
    ids = m.tokenizer.encode(text)
    return datasets.text_windows(ids, min(args.length, len(ids)), args.batch, seed=args.seed)
  try:
    conversations = datasets.read_conversations(args.chat)
  except OSError as e:
    raise E.UsageError(f"--chat {args.chat}: {e.strerror}") from None
  return datasets.chat_batches(m, conversations, args.length, args.batch, seed=args.seed)


def execute(args: argparse.Namespace) -> dict:
  """Train and write the adapter; returns the losses and the paths written."""
  import jax.numpy as jnp
  import optax

  from q8rules.llm import compile_cache
  from q8rules.llm.finetune import LoraTrainer
  from q8rules.llm.load import load_gguf

  compile_cache.enable()
  m = load_gguf(args.model, dtype=jnp.float32, progress=not args.no_progress)
  targets = args.targets.split(",") if args.targets else None
  m = m.with_lora(rank=args.rank, alpha=args.alpha, targets=targets, seed=args.seed)
  draw = batches_of(m, args)
  trainer = LoraTrainer(m, optax.adamw(args.lr), seed=args.seed)
  state = trainer.init()
  print(
    f"{args.model}: LoRA rank {args.rank}, alpha {args.alpha} on {', '.join(m.lora.targets)};"
    f" {args.steps} steps of {args.batch} x {args.length} tokens",
    file=sys.stderr,
  )
  from tqdm.auto import tqdm

  losses = []
  start = time.perf_counter()
  bar = tqdm(range(args.steps), desc="finetune", disable=args.no_progress, file=sys.stderr)
  for step in bar:
    tokens, mask = draw()
    state, loss = trainer.step(state, tokens, mask)
    losses.append(float(loss))
    bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
      recent = losses[-args.log_every :]
      print(f"step {step + 1}: loss {sum(recent) / len(recent):.4f}", file=sys.stderr)
  seconds = time.perf_counter() - start
  trained = trainer.model(state)
  out = trained.save_lora_gguf(args.out)
  print(f"wrote {out} ({seconds:.1f} s of training)", file=sys.stderr)
  written = {"adapter": str(out)}
  if args.merged:
    merged = trained.merged()
    written["merged"] = str(merged.save_gguf(args.merged))
    print(f"wrote {args.merged}", file=sys.stderr)
  return dict(losses=losses, **written)
