"""`q8rules serve MODEL.gguf`: an OpenAI-compatible server (`q8rules.serve`) with continuous
batching: up to --parallel requests are decoded together, one slot of a batched KV cache each,
and more wait in a queue.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models,
/health, /metrics (Prometheus), /openapi.json, POST /tokenize and /detokenize, and a chat page
at /. Listens on 127.0.0.1:8080 unless told otherwise (the port is taken before the model
loads, so a port in use fails at once); Ctrl-C or SIGTERM ends it (running streams get a final
event). Past --parallel running and --max-queue waiting requests, more are answered 503 with
Retry-After. If the engine fails, every request gets a 503 and the command exits 1, for a
supervisor to restart it. docs/serve.md has curl and `openai` client examples.
"""

from __future__ import annotations

import argparse
import socket
import sys

from q8rules.cli import errors as E
from q8rules.cli.load_options import add_load_options, load_model
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
  p.add_argument("--max-queue", type=E.non_negative_int, default=None,
                 help="requests that may wait for a slot; past it 503 with Retry-After (None:"
                 " 8 per slot)")  # fmt: skip
  p.add_argument("--timeout", type=E.non_negative_float, default=600.0,
                 help="the most seconds a completion may take, from its arrival to its last"
                 " token; past it 503 (0: no limit)")  # fmt: skip
  p.add_argument("--limit-concurrency", type=E.positive_int, default=None,
                 help="uvicorn's: the most connections at once, past which it answers 503"
                 " (None: max(512, 4 x (parallel + max queue)))")  # fmt: skip
  p.add_argument("--api-key", default=None,
                 help="require 'Authorization: Bearer KEY' on every endpoint but /, /health and"
                 " /openapi.json (None: no key; a warning when listening beyond this machine)")  # fmt: skip
  p.add_argument("--cors", action="append", default=None, metavar="ORIGIN",
                 help="let pages from ORIGIN (e.g. https://app.example.com) call the API from a"
                 " browser (repeatable; None: no CORS)")  # fmt: skip
  p.add_argument("--alias", default=None,
                 help="the model's id in the API (None: the file's name)")  # fmt: skip
  p.add_argument("--chunk", type=E.positive_int, default=128,
                 help="the longest prompt chunk prefilled between two decode steps (a power of 2)")  # fmt: skip
  p.add_argument("--steps", type=E.positive_int, default=4,
                 help="the most decode steps one device program runs while no prompt waits (1: a"
                 " program per token)")  # fmt: skip
  add_load_options(p)


def execute(args: argparse.Namespace) -> dict:
  """Take the port, then load the model and serve it until interrupted (or until the engine
  fails: exit 1)."""
  from q8rules.engine.scheduler import EngineDown
  from q8rules.serve import bind

  if args.chunk & (args.chunk - 1):
    raise E.UsageError(f"--chunk {args.chunk}: a power of 2 is needed")
  try:
    sock = bind(args.host, args.port)
  except OSError as e:
    raise E.UsageError(
      f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})"
    ) from None
  try:
    return load_and_serve(args, sock)
  except EngineDown as e:
    E.fail(str(e), 1)
  finally:
    sock.close()


def load_and_serve(args: argparse.Namespace, sock: socket.socket) -> dict:
  """Load the model of `args` and serve it on `sock` (bound) until interrupted."""
  from q8rules.serve import serve

  m = load_model(args)
  c = m.config
  if args.ctx is not None and args.ctx > c.context_length:
    raise E.UsageError(f"--ctx {args.ctx}: the model's context is {c.context_length}")
  port = sock.getsockname()[1]
  print(
    f"{args.model}: {c.arch}, {c.layers} layers, dim {c.dim}, vocab {c.vocab}; compiling, then"
    f" serving on http://{args.host}:{port} ({args.parallel} slots)",
    file=sys.stderr,
    flush=True,
  )
  serve(
    m,
    sock=sock,
    parallel=args.parallel,
    ctx=args.ctx,
    api_key=args.api_key,
    name=args.alias,
    chunk=args.chunk,
    steps=args.steps,
    max_queue=args.max_queue,
    timeout=args.timeout or None,
    limit_concurrency=args.limit_concurrency,
    cors=args.cors,
  )
  return dict(model=args.model)
