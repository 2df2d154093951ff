"""An OpenAI-compatible server with continuous batching: `q8rules serve MODEL.gguf`, or
`q8rules.serve(model)` for any `GGUFModel`.

  protocol.py   the request shapes and their checks
  responses.py  the response bodies
  errors.py     OpenAI-style errors, and validation errors read as one 400 naming the field
  api.py        the endpoints' work: a request checked, queued, answered whole or streamed
  app.py        the FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health,
                /metrics, /tokenize, /detokenize, /openapi.json, the chat page at /
  guards.py     what a request passes first: the key, a JSON body within the limit, room

The engine under it (the scheduler, the batched runner, the sampler chain, the detokenizer,
the metrics) is `q8rules.engine`; its sampler chain and detokenizer are `q8rules run`'s and
`chat`'s too.

    import q8rules
    m = q8rules.load_gguf("model-q8_0.gguf")
    q8rules.serve(m, port=8080, parallel=4)      # blocks; Ctrl-C or SIGTERM ends it

    with Server(m, port=0) as server:            # in a thread (tests, notebooks)
      print(server.url)                          # http://127.0.0.1:PORT

A request's tokens and log-probabilities are the same bits whether it runs alone or beside
others, in any slot (docs/serve.md says how).

If the engine fails, `/health` answers 503 and every waiting or running request a 503 at once;
`serve` then stops and raises `EngineDown` (`q8rules serve` exits 1), so that a supervisor can
restart it. A `Server` keeps answering (503) until stopped.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

DEFAULT_CONTEXT = 4096
"""Positions per slot when none is given (the model's context length if shorter)."""

QUEUE_PER_SLOT = 8
"""The default `max_queue`: this many waiting requests per slot."""

TIMEOUT = 600.0
"""The default seconds a completion request may take, from its arrival to its last token
(llama-server's default --timeout)."""

CONCURRENCY_FLOOR = 512
"""The default `limit_concurrency` is at least this many connections (half a common open-file
limit of 1024)."""

log = logging.getLogger("q8rules.serve")


def default_max_queue(parallel: int) -> int:
  """Waiting requests allowed beyond the running ones: `QUEUE_PER_SLOT` per slot."""
  return QUEUE_PER_SLOT * parallel


def default_limit_concurrency(parallel: int, max_queue: int) -> int:
  """uvicorn's `limit_concurrency` (connections and tasks at once; past it uvicorn answers 503
  to any path): room for every admitted request four times over, at least
  `CONCURRENCY_FLOOR`, so the API sheds first, with OpenAI's body and Retry-After, and /health
  still answers under a flood."""
  return max(CONCURRENCY_FLOOR, 4 * (parallel + max_queue))


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
  max_queue: int | None = None,
  timeout: float | None = TIMEOUT,
  cors: list[str] | None = None,
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
    max_queue: completion requests that may wait beyond the `parallel` running (or being
      tokenized) before more are shed with 503 and Retry-After (default
      `default_max_queue(parallel)`).
    timeout: the most seconds a completion request may take from arrival to its last token
      (None or 0: no limit); past it, it is cancelled and answered 503.
    cors: origins whose pages may call the API (None: no CORS headers; browsers then refuse
      cross-origin calls).
    warm_up: compile every program before returning.
  """
  from q8rules.engine.runner import CHUNK, STEPS, BatchRunner
  from q8rules.engine.scheduler import Scheduler
  from q8rules.serve.api import API, MAX_BODY
  from q8rules.serve.app import create_app

  if parallel < 1:
    raise ValueError(f"parallel must be >= 1, got {parallel}")
  if max_queue is not None and max_queue < 0:
    raise ValueError(f"max_queue must be >= 0, got {max_queue}")
  if timeout is not None and timeout < 0:
    raise ValueError(f"timeout must be >= 0 (0: none), got {timeout}")
  context = min(DEFAULT_CONTEXT, model.config.context_length) if ctx is None else ctx
  runner = BatchRunner(model, parallel, context, chunk or CHUNK, steps or STEPS)
  if warm_up:
    runner.warm_up()
  scheduler = Scheduler(runner, model.tokenizer)
  scheduler.start()
  queue = default_max_queue(parallel) if max_queue is None else max_queue
  api = API(model, scheduler, name or Path(str(model.path)).name, timeout or None)
  app = create_app(
    api, api_key, max_body=max_body or MAX_BODY, max_active=parallel + queue, cors=cors
  )
  return app, scheduler


def is_loopback(host: str) -> bool:
  """Whether `host` names only this machine (127.0.0.0/8, ::1, 'localhost')."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def bind(host: str, port: int) -> socket.socket:
  """A TCP socket bound to `host`:`port` (0: a free port), not listening yet: the port is taken
  now (an `OSError` if it is in use), and connections are refused until the server listens.

  Raises:
    OSError: the address is in use, not this machine's, or needs privileges.
  """
  family, kind, proto, _, address = socket.getaddrinfo(
    host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
  )[0]
  sock = socket.socket(family, kind, proto)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    sock.bind(address)
  except OSError:
    sock.close()
    raise
  return sock


def _uvicorn_server(
  app: Any,
  sock: socket.socket,
  scheduler: Any,
  log_level: str,
  limit_concurrency: int | None,
  exit_on_failure: bool,
) -> Any:
  """A uvicorn server on `sock` whose exit (SIGINT, SIGTERM, `should_exit`) first stops the
  engine, so every running stream gets its final event before the connections close; with
  `exit_on_failure` it also exits once the engine has failed."""
  import uvicorn

  class EngineServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: Any) -> None:
      scheduler.stop(timeout=0)
      super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
      if exit_on_failure and scheduler.failure is not None:
        self.should_exit = True
      return await super().on_tick(counter)

  host, port = sock.getsockname()[:2]
  config = uvicorn.Config(
    app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
    lifespan="off", limit_concurrency=limit_concurrency,
  )  # fmt: skip
  return EngineServer(config)


def _concurrency(options: dict[str, Any], limit: int | None) -> int:
  parallel = options.get("parallel", 4)
  queue = options.get("max_queue")
  queue = default_max_queue(parallel) if queue is None else queue
  return limit if limit is not None else default_limit_concurrency(parallel, queue)


def serve(
  model: Any,
  *,
  host: str = "127.0.0.1",
  port: int = 8080,
  log_level: str = "info",
  limit_concurrency: int | None = None,
  sock: socket.socket | None = None,
  **options: Any,
) -> None:
  """Serve `model` (a `GGUFModel` on one device) over HTTP until interrupted (SIGINT or
  SIGTERM: running streams get a final event, then the port is freed) or until the engine
  fails (`EngineDown` raised once every request has its 503).

  Args:
    model: the model (`q8rules.load_gguf`).
    host, port: where to listen (loopback by default); the port is taken before the model is
      compiled, so a port in use fails at once.
    log_level: uvicorn's.
    limit_concurrency: uvicorn's: the most connections and tasks at once, past which uvicorn
      answers any request 503 (default `default_limit_concurrency`).
    sock: a socket from `bind` to listen on instead of `host` and `port`.
    **options: `build`'s keywords (parallel, ctx, api_key, name, chunk, steps, max_body,
      max_queue, timeout, cors, warm_up), with its defaults.

  Raises:
    OSError: the port is in use (before anything is compiled).
    EngineDown: the engine failed (after the server has stopped).
  """
  from q8rules.engine.scheduler import EngineDown

  sock = sock if sock is not None else bind(host, port)
  bound = sock.getsockname()[0]
  if not is_loopback(bound) and not options.get("api_key"):
    log.warning(
      "q8rules serve: listening on %s without an API key: anyone who can reach this port can"
      " use the model (--api-key KEY)", bound,
    )  # fmt: skip
  try:
    app, scheduler = build(model, **options)
    limit = _concurrency(options, limit_concurrency)
    server = _uvicorn_server(app, sock, scheduler, log_level, limit, exit_on_failure=True)
    try:
      server.run(sockets=[sock])
    finally:
      scheduler.stop()
  finally:
    sock.close()
  if scheduler.failure is not None:
    raise EngineDown(f"the engine failed: {scheduler.failure_message()}")


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nobody listens on now."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class Server:
  """`serve` in a background thread: `with Server(model) as s: ... s.url ...`. If the engine
  fails, the server goes on answering (/health and completions 503) until stopped.

  Args: as `serve`'s (`port=0`: a free port).
  """

  def __init__(
    self,
    model: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limit_concurrency: int | None = None,
    **options: Any,
  ):
    self.host = host
    self._sock = bind(host, port)
    self.port = self._sock.getsockname()[1]
    try:
      self.app, self.scheduler = build(model, **options)
    except BaseException:
      self._sock.close()
      raise
    limit = _concurrency(options, limit_concurrency)
    self._server = _uvicorn_server(
      self.app, self._sock, self.scheduler, "warning", limit, exit_on_failure=False
    )
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 30.0) -> Server:
    self._thread = threading.Thread(
      target=self._server.run, kwargs={"sockets": [self._sock]}, name="q8rules-http", daemon=True
    )
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
    self._sock.close()

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

__all__ = [
  "CONCURRENCY_FLOOR",
  "DEFAULT_CONTEXT",
  "QUEUE_PER_SLOT",
  "TIMEOUT",
  "Server",
  "bind",
  "build",
  "default_limit_concurrency",
  "default_max_queue",
  "free_port",
  "is_loopback",
  "serve",
]
