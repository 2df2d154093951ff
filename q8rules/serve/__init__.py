"""An OpenAI-compatible server with continuous batching: `q8rules serve MODEL.gguf`, or
`q8rules.serve(model)` for any `GGUFModel`.

  protocol.py   the request and response shapes, their checks, OpenAI-style errors
  api.py        the FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health,
                /metrics, /tokenize, /detokenize, the chat page at /
  scheduler.py  the queue, the slots, chunked prefill between decode steps, cancellation
  runner.py     the batched KV cache and its programs (a prompt chunk, a decode step)
  sampling.py   per-request sampling, batch-invariant
  output.py     incremental text and stop strings

    import q8rules
    m = q8rules.load_gguf("model-q8_0.gguf")
    q8rules.serve(m, port=8080, parallel=4)      # blocks; Ctrl-C or SIGTERM ends it

    with Server(m, port=0) as server:            # in a thread (tests, notebooks)
      print(server.url)                          # http://127.0.0.1:PORT

A request's tokens and log-probabilities are the same bits whether it runs alone or beside
others, in any slot (docs/serve.md says how).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

DEFAULT_CONTEXT = 4096
"""Positions per slot when none is given (the model's context length if shorter)."""


def build(
  model: Any,
  *,
  parallel: int = 4,
  ctx: int | None = None,
  api_key: str | None = None,
  name: str | None = None,
  chunk: int | None = None,
  steps: int | None = None,
  max_body: int | None = None,
  warm_up: bool = True,
) -> tuple[Any, Any]:
  """The ASGI app and its engine (started) for `model`.

  Args:
    model: the model (`q8rules.load_gguf`), a `GGUFModel` on one device.
    parallel: requests decoded together (slots of the batched KV cache); more wait in a queue.
    ctx: positions per slot, the prompt and the reply together (default the model's context
      length, at most `DEFAULT_CONTEXT`).
    api_key: when given, every endpoint but / and /health needs `Authorization: Bearer KEY`.
    name: the model's id in the API (default the file's name).
    chunk: the longest prompt chunk prefilled between decode steps (a power of 2; default
      `runner.CHUNK`).
    steps: the most decode steps one device program runs while no prompt waits for a chunk
      (default `runner.STEPS`; 1: a program per token).
    max_body: the largest request body in bytes (default `api.MAX_BODY`).
    warm_up: compile every program before returning.
  """
  from q8rules.serve.api import API, MAX_BODY, create_app
  from q8rules.serve.runner import CHUNK, STEPS, BatchRunner
  from q8rules.serve.scheduler import Scheduler

  if parallel < 1:
    raise ValueError(f"parallel must be >= 1, got {parallel}")
  context = min(DEFAULT_CONTEXT, model.config.context_length) if ctx is None else ctx
  runner = BatchRunner(model, parallel, context, chunk or CHUNK, steps or STEPS)
  if warm_up:
    runner.warm_up()
  scheduler = Scheduler(runner, model.tokenizer)
  scheduler.start()
  api = API(model, scheduler, name or Path(str(model.path)).name, max_body or MAX_BODY)
  return create_app(api, api_key), scheduler


def _uvicorn_server(app: Any, host: str, port: int, scheduler: Any, log_level: str) -> Any:
  """A uvicorn server whose exit (SIGINT, SIGTERM, `should_exit`) first stops the engine, so
  every running stream gets its final event before the connections close."""
  import uvicorn

  class EngineServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: Any) -> None:
      scheduler.stop(timeout=0)
      super().handle_exit(sig, frame)

  config = uvicorn.Config(
    app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10, lifespan="off"
  )
  return EngineServer(config)


def serve(
  model: Any,
  *,
  host: str = "127.0.0.1",
  port: int = 8080,
  log_level: str = "info",
  **options: Any,
) -> None:
  """Serve `model` (a `GGUFModel` on one device) over HTTP until interrupted (SIGINT or
  SIGTERM: running streams get a final event, then the port is freed).

  Args:
    model: the model (`q8rules.load_gguf`).
    host, port: where to listen (loopback by default).
    log_level: uvicorn's.
    **options: `build`'s keywords (parallel, ctx, api_key, name, chunk, max_body, warm_up),
      with its defaults.
  """
  app, scheduler = build(model, **options)
  server = _uvicorn_server(app, host, port, scheduler, log_level)
  try:
    server.run()
  finally:
    scheduler.stop()


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nobody listens on now."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class Server:
  """`serve` in a background thread: `with Server(model) as s: ... s.url ...`.

  Args: as `serve`'s (`port=0`: a free port).
  """

  def __init__(
    self,
    model: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    **options: Any,
  ):
    self.host = host
    self.port = port or free_port(host)
    self.app, self.scheduler = build(model, **options)
    self._server = _uvicorn_server(self.app, self.host, self.port, self.scheduler, "warning")
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 30.0) -> Server:
    self._thread = threading.Thread(target=self._server.run, name="q8rules-http", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + timeout
    while not self._server.started:
      if time.monotonic() > deadline or not self._thread.is_alive():
        raise RuntimeError(f"the server did not start on {self.url}")
      time.sleep(0.02)
    return self

  def stop(self, timeout: float = 30.0) -> None:
    self._server.handle_exit(15, None)
    if self._thread is not None:
      self._thread.join(timeout)
    self.scheduler.stop()

  def __enter__(self) -> Server:
    return self.start()

  def __exit__(self, *exc: Any) -> None:
    self.stop()


class _CallableModule(types.ModuleType):
  """This package, callable as `serve`: `q8rules.serve(model)` works whether `q8rules.serve`
  names the package (once imported) or the function."""

  def __call__(self, model: Any, **options: Any) -> None:
    serve(model, **options)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["DEFAULT_CONTEXT", "Server", "build", "free_port", "serve"]
