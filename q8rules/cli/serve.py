"""`q8rules serve MODEL.gguf`: an OpenAI-compatible server (`q8rules.serve`) with continuous
batching: up to --parallel requests are decoded together, one slot of a batched KV cache each,
and more wait in a queue.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models,
/health, /metrics (Prometheus), POST /tokenize and /detokenize, and a chat page at /. Listens
on 127.0.0.1:8080 unless told otherwise; Ctrl-C or SIGTERM ends it (running streams get a final
event). docs/serve.md has curl and `openai` client examples.
"""

from __future__ import annotations

import argparse
import sys

from q8rules.cli import errors as E
from q8rules.cli.threads import add_threads

NAME = "serve"
HELP = "serve a GGUF model over an OpenAI-compatible HTTP API"
EXAMPLE = "q8rules serve SmolLM2-135M-Instruct.Q8_0.gguf --port 8080 --parallel 4"


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("model", help="a .gguf file (or the first part of a split set)")
  p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
  p.add_argument("--port", type=E.positive_int, default=8080, help="the port to listen on")
  p.add_argument("-np", "--parallel", type=E.positive_int, default=4,
                 help="requests decoded together (slots of the batched KV cache); more wait")  # fmt: skip
  p.add_argument("-c", "--ctx", type=E.positive_int, default=None,
                 help="positions per slot, prompt and reply together (None: the model's context"
                 " length, at most 4096)")  # fmt: skip
  add_threads(p)
  p.add_argument("--lora", action="append", default=None, metavar="FILE",
                 help="a llama.cpp LoRA adapter file, applied unmerged (repeatable; None: no"
                 " adapter)")  # fmt: skip
  p.add_argument("--lora-scale", type=E.finite_float, default=1.0,
                 help="the adapters' lora_scale (llama.cpp's --lora-scaled)")  # fmt: skip
  p.add_argument("--api-key", default=None,
                 help="require 'Authorization: Bearer KEY' on every endpoint but / and /health"
                 " (None: no key)")  # fmt: skip
  p.add_argument("--alias", default=None,
                 help="the model's id in the API (None: the file's name)")  # fmt: skip
  p.add_argument("--chunk", type=E.positive_int, default=128,
                 help="the longest prompt chunk prefilled between two decode steps (a power of 2)")  # fmt: skip
  p.add_argument("--steps", type=E.positive_int, default=4,
                 help="the most decode steps one device program runs while no prompt waits (1: a"
                 " program per token)")  # fmt: skip
  p.add_argument("--bf16", action="store_true",
                 help="bfloat16 activations (default float32, as llama.cpp)")  # fmt: skip
  p.add_argument("--act-qtype", choices=["q8_0"], default=None,
                 help="Q8_0 activations too, as llama.cpp (int8 block dots; None: float)")  # fmt: skip
  p.add_argument("--no-progress", action="store_true",
                 help="no loading progress bar (it shows only on a terminal anyway)")  # fmt: skip


def execute(args: argparse.Namespace) -> dict:
  """Load the model and serve it until interrupted."""
  import jax.numpy as jnp

  from q8rules.cli.progress import bars
  from q8rules.llm import compile_cache
  from q8rules.llm.load import load_gguf
  from q8rules.serve import serve

  if args.chunk & (args.chunk - 1):
    raise E.UsageError(f"--chunk {args.chunk}: a power of 2 is needed")
  compile_cache.enable()
  m = load_gguf(
    args.model,
    dtype=jnp.bfloat16 if args.bf16 else jnp.float32,
    progress=bars(args.no_progress),
    act_qtype=args.act_qtype,
    lora=args.lora,
    lora_scale=args.lora_scale,
  )
  c = m.config
  if args.ctx is not None and args.ctx > c.context_length:
    raise E.UsageError(f"--ctx {args.ctx}: the model's context is {c.context_length}")
  print(
    f"{args.model}: {c.arch}, {c.layers} layers, dim {c.dim}, vocab {c.vocab}; compiling, then"
    f" serving on http://{args.host}:{args.port} ({args.parallel} slots)",
    file=sys.stderr,
    flush=True,
  )
  serve(
    m,
    host=args.host,
    port=args.port,
    parallel=args.parallel,
    ctx=args.ctx,
    api_key=args.api_key,
    name=args.alias,
    chunk=args.chunk,
    steps=args.steps,
  )
  return dict(model=args.model)
