"""The HTTP API: OpenAI's completions endpoints and llama-server's extras, on FastAPI.

  POST /v1/chat/completions   chat through the file's chat template; streamed (server-sent
                              events, as OpenAI's) with "stream": true
  POST /v1/completions        text (or token ids) in, text out; streamed likewise
  GET  /v1/models             the one model served
  GET  /health                200 {"status": "ok", ...} while the engine runs, else 503
                              (no key needed)
  GET  /metrics               Prometheus text (`q8rules.serve.metrics`)
  POST /tokenize, /detokenize llama-server's
  GET  /openapi.json          the OpenAPI schema of all of these (no key needed)
  GET  /                      a chat page (static HTML and JS; no key needed)

The handlers take typed bodies (`protocol`'s pydantic models), so FastAPI validates them and
`/openapi.json` describes them. Every error is OpenAI's JSON body (`protocol.APIError`) with its
status: 400 for a malformed or invalid request (JSON, fields, ranges, a prompt past the
context, a template that fails to render), 401 for a missing or wrong key when the server has
one, 404 for an unknown model or path, 413 for a body over the limit, 415 for a body that is
not JSON, 500 when the server fails on a request, 503 when it is full (`Retry-After`), a
request runs past its timeout, or the engine has stopped. `guards` runs before the handlers.

Rendering the chat template and tokenizing run in worker threads, off the event loop. A client
that disconnects cancels its request, streamed or not: the engine frees its slot at its next
turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp

from q8rules.serve import protocol as P
from q8rules.serve.guards import Admission, KeyCheck, PostBody
from q8rules.serve.scheduler import (
  DoneEvent,
  EngineDown,
  ErrorEvent,
  Request,
  Scheduler,
  TokenEvent,
)

MAX_BODY = 4 << 20
"""The largest request body read (bytes); a larger one gets 413."""

log = logging.getLogger("q8rules.serve")

GONE = object()
"""Put on a request's event queue when its client disconnects."""


class ASCIIJSONResponse(JSONResponse):
  """JSON with every non-ASCII character escaped: an error may quote what the client sent,
  and text with an unpaired surrogate has no UTF-8 bytes."""

  def render(self, content: Any) -> bytes:
    return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(e: P.APIError) -> JSONResponse:
  return ASCIIJSONResponse(e.body(), status_code=e.status, headers=e.headers)


def sse(data: Any) -> str:
  """One server-sent event carrying `data` as JSON (or the literal '[DONE]')."""
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class API:
  """The endpoints over one model and its engine.

  Args:
    model: the `GGUFModel` served (its tokenizer, chat template and config).
    scheduler: the engine (`q8rules.serve.scheduler.Scheduler`), started.
    name: the model's id in `/v1/models` and in responses; a request naming another model
      gets 404.
    timeout: the most seconds a completion request may take from its arrival to its last
      token (None: no limit); past it, it is cancelled and answered 503.
  """

  def __init__(self, model: Any, scheduler: Scheduler, name: str, timeout: float | None = None):
    self.model = model
    self.scheduler = scheduler
    self.name = name
    self.timeout = timeout
    self.context = scheduler.runner.context
    self.vocab = model.config.vocab
    self.metrics = scheduler.metrics
    tok = model.tokenizer
    self.stop_ids = frozenset(tok.eog_ids) if tok is not None else frozenset()

  def count_error(self, status: int) -> None:
    self.metrics.http_errors.labels(status=str(status)).inc()

  # --- checks ---------------------------------------------------------------------------------

  def check_model(self, model: str | None) -> None:
    names = {self.name, Path(self.name).stem, ""}
    if model is not None and model not in names:
      raise P.APIError(
        404, f"the model '{model}' is not served here; this server serves '{self.name}'",
        param="model", code="model_not_found",
      )  # fmt: skip

  def check_vocab(self, body: Any) -> None:
    """`top_k` and the `logit_bias` ids within the vocabulary (APIError 400 naming them)."""
    if body.top_k is not None and body.top_k > self.vocab:
      raise P.APIError(
        400, f"top_k: {body.top_k} is more than the vocabulary's {self.vocab} ids", param="top_k"
      )
    bad = [i for i in body.bias() if i >= self.vocab]
    if bad:
      raise P.APIError(
        400, f"logit_bias: token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab})",
        param="logit_bias",
      )  # fmt: skip

  def tokenizer(self) -> Any:
    if self.model.tokenizer is None:
      raise P.APIError(400, f"{self.name}: no tokenizer could be built; send token ids")
    return self.model.tokenizer

  def check_ids(self, ids: list[int], limit: int | None, param: str) -> int:
    """The number of tokens to generate: `limit`, or what the context leaves (APIError 400
    naming `param` (the prompt's field) when the prompt is empty, has an id outside the
    vocabulary or fills the context, or `max_tokens` when the prompt and `limit` do not fit)."""
    if not ids:
      raise P.APIError(400, f"{param}: the prompt is empty", param=param)
    bad = [i for i in ids if not 0 <= i < self.vocab]
    if bad:
      raise P.APIError(
        400, f"{param}: token ids {bad[:5]} lie outside [0, {self.vocab})", param=param
      )
    if len(ids) >= self.context:
      raise P.APIError(
        400, f"{param}: the prompt's {len(ids)} tokens fill the context of {self.context} tokens;"
        " nothing is left to generate", param=param, code="context_length_exceeded",
      )  # fmt: skip
    if limit is None:
      return self.context - len(ids)
    if len(ids) + limit > self.context:
      raise P.APIError(
        400, f"max_tokens: the prompt's {len(ids)} tokens and max_tokens {limit} exceed the"
        f" context of {self.context} tokens", param="max_tokens", code="context_length_exceeded",
      )  # fmt: skip
    return limit

  # --- prompts (in worker threads) ------------------------------------------------------------

  def chat_ids(self, body: P.ChatCompletionRequest) -> list[int]:
    """The chat template over `body.messages`, tokenized."""
    from q8rules.llm.chat import ChatTemplateError

    self.tokenizer()
    messages = [m.as_template_input() for m in body.messages]
    try:
      return list(self.model.apply_chat_template(messages, add_generation_prompt=True))
    except ChatTemplateError as e:
      raise P.APIError(400, str(e), param="messages", code="template_error") from None
    except UnicodeError as e:
      raise P.APIError(
        400, f"messages: the text is not valid Unicode ({e})", param="messages"
      ) from None
    except ValueError as e:  # a message the renderer refuses
      raise P.APIError(400, str(e), param="messages") from None

  def completion_ids(self, body: P.CompletionRequest) -> list[int]:
    """The prompt's ids: `body.prompt` tokenized, or as given."""
    if not isinstance(body.prompt, str):
      return list(body.prompt)
    tok = self.tokenizer()
    try:
      ids = tok.encode(body.prompt)
    except UnicodeError as e:
      raise P.APIError(
        400, f"prompt: the text is not valid Unicode ({e})", param="prompt"
      ) from None
    return ids or ([tok.bos_id] if tok.bos_id is not None else [])

  def tokenize(self, body: P.TokenizeRequest) -> dict[str, Any]:
    tok = self.tokenizer()
    try:
      ids = tok.encode(body.content, add_special=body.add_special, parse_special=True)
    except UnicodeError as e:
      raise P.APIError(
        400, f"content: the text is not valid Unicode ({e})", param="content"
      ) from None
    if not body.with_pieces:
      return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": tok.decode([i], special=True)} for i in ids]}

  def detokenize(self, body: P.DetokenizeRequest) -> dict[str, Any]:
    bad = [i for i in body.tokens if not 0 <= i < self.vocab]
    if bad:
      raise P.APIError(400, f"tokens: ids {bad[:5]} lie outside [0, {self.vocab})", param="tokens")
    return {"content": self.tokenizer().decode(body.tokens)}

  # --- completions ----------------------------------------------------------------------------

  def logprob_entries(self, logprobs: list[tuple[int, float, list[tuple[int, float]]]]) -> list:
    def piece(i: int) -> str:
      tok = self.model.tokenizer
      return tok.decode([i], special=True) if tok is not None else f" {i}"

    def entry(i: int, lp: float) -> dict[str, Any]:
      text = piece(i)
      return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
      {**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]} for i, lp, top in logprobs
    ]

  async def complete(self, http: HTTPRequest, body: Any, chat: bool) -> Response:
    """A chat or text completion: checked, tokenized off the loop, run by the engine."""
    arrived = time.perf_counter()
    self.check_model(body.model)
    self.check_vocab(body)
    if chat:
      ids = await run_in_threadpool(self.chat_ids, body)
    else:
      ids = await run_in_threadpool(self.completion_ids, body)
    limit = self.check_ids(ids, body.limit(), "messages" if chat else "prompt")
    want, top = body.logprob_settings()
    try:
      params = body.sampling(secrets.randbits(31), want, top)
    except ValueError as e:
      raise P.APIError(400, str(e)) from None
    loop = asyncio.get_running_loop()
    queue, emit = Request.queue_for(loop)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    stop_ids = frozenset() if body.ignore_eos else self.stop_ids
    request = Request(ids, limit, params, body.stops(), stop_ids, emit, rid=rid, arrived=arrived)
    try:
      self.scheduler.submit(request)
    except EngineDown as e:
      raise P.APIError(503, str(e)) from None
    timer = None
    if self.timeout is not None:
      left = max(0.0, self.timeout - (time.perf_counter() - arrived))
      timer = loop.call_later(left, self._expire, request, queue)
    if body.stream:
      return StreamingResponse(
        self.stream(request, queue, rid, chat, body.include_usage(), timer),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
      )
    try:
      return await self.whole(http, request, queue, rid, chat, want)
    finally:
      if timer is not None:
        timer.cancel()

  def _cancel(self, request: Request) -> None:
    request.cancel()
    self.scheduler.wake()

  def _expire(self, request: Request, queue: asyncio.Queue) -> None:
    """`request` ran past the timeout: cancelled, and its reader told (503)."""
    if request.ended:
      return
    self._cancel(request)
    message = f"the request ran past the server's timeout of {self.timeout:g} s and was cancelled"
    queue.put_nowait(ErrorEvent(message, 503))

  async def _watch(self, http: HTTPRequest, request: Request, queue: asyncio.Queue) -> None:
    """Wait for the client to disconnect (its body is in already): then cancel `request`."""
    while (await http.receive())["type"] != "http.disconnect":
      pass
    self._cancel(request)
    queue.put_nowait(GONE)

  async def whole(
    self,
    http: HTTPRequest,
    request: Request,
    queue: asyncio.Queue,
    rid: str,
    chat: bool,
    want: bool,
  ) -> Response:
    text, entries = [], []
    watcher = asyncio.ensure_future(self._watch(http, request, queue))
    try:
      while True:
        event = await queue.get()
        if event is GONE:
          return Response(status_code=499)  # nobody reads it
        if isinstance(event, TokenEvent):
          text.append(event.text)
          entries.extend(self.logprob_entries(event.logprobs or []))
        elif isinstance(event, ErrorEvent):
          raise P.APIError(event.status, event.message)
        else:
          break
    except BaseException:  # an error, or the handler cancelled: the engine drops the request
      self._cancel(request)
      raise
    finally:
      watcher.cancel()
    done: DoneEvent = event
    text.append(done.text)
    content = "".join(text)
    if chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": content}}
      if want:
        choice["logprobs"] = P.chat_logprobs(entries)
      kind = "chat.completion"
    else:
      choice = {"index": 0, "text": content}
      choice["logprobs"] = P.completion_logprobs(entries, 0) if want else None
      kind = "text_completion"
    choice["finish_reason"] = done.finish_reason
    out = P.base(kind, rid, self.name)
    out["choices"] = [choice]
    out["usage"] = P.usage(done.prompt_tokens, done.completion_tokens)
    return JSONResponse(out)

  async def stream(
    self,
    request: Request,
    queue: asyncio.Queue,
    rid: str,
    chat: bool,
    include_usage: bool,
    timer: asyncio.TimerHandle | None = None,
  ) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    offset = 0

    def chunk(text: str | None, finish: str | None, entries: list | None = None) -> dict:
      nonlocal offset
      out = P.base(kind, rid, self.name)
      if chat:
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if entries:
          choice["logprobs"] = P.chat_logprobs(entries)
      else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        choice["logprobs"] = P.completion_logprobs(entries, offset) if entries else None
        offset += len(text or "")
      out["choices"] = [choice]
      if include_usage:
        out["usage"] = None
      return out

    ended = False
    try:
      if chat:
        first = chunk(None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield sse(first)
      while True:
        event = await queue.get()
        if isinstance(event, TokenEvent):  # with every token already queued: one write
          out = []
          while isinstance(event, TokenEvent):
            out.append(sse(chunk(event.text, None, self.logprob_entries(event.logprobs or []))))
            event = queue.get_nowait() if not queue.empty() else None
          yield "".join(out)
          if event is None:
            continue
        ended = True
        if isinstance(event, ErrorEvent):
          self.count_error(event.status)
          yield sse(P.APIError(event.status, event.message).body())
          yield sse("[DONE]")
          return
        if event.text:
          yield sse(chunk(event.text, None))
        yield sse(chunk(None if chat else "", event.finish_reason))
        if include_usage:
          last = P.base(kind, rid, self.name)
          last["choices"] = []
          last["usage"] = P.usage(event.prompt_tokens, event.completion_tokens)
          yield sse(last)
        yield sse("[DONE]")
        return
    finally:
      if timer is not None:
        timer.cancel()
      if not ended:  # the client went away (or the server is closing the stream)
        self._cancel(request)

  # --- the rest -------------------------------------------------------------------------------

  def models(self) -> dict[str, Any]:
    c = self.model.config
    meta = {
      "arch": c.arch,
      "vocab": c.vocab,
      "n_ctx_train": c.context_length,
      "n_ctx": self.context,
    }
    card = {"id": self.name, "object": "model", "created": 0, "owned_by": "q8rules", "meta": meta}
    return {"object": "list", "data": [card]}

  def health(self) -> tuple[int, dict[str, Any]]:
    """(200, {"status": "ok", ...}) while the engine runs; (503, {"status": "error", "error":
    why, ...}) once it has stopped or failed."""
    s = self.scheduler
    out: dict[str, Any] = {
      "status": "ok" if s.alive else "error",
      "slots_idle": s.runner.slots - s.running,
      "slots_processing": s.running,
      "requests_waiting": s.queued,
    }
    if out["status"] == "ok":
      return 200, out
    out["error"] = (
      f"the engine failed ({s.failure_message()})" if s.failure else "the engine is not running"
    )
    return 503, out

  def retry_after(self) -> int:
    """Seconds a shed client should wait: the requests ahead of it over the slots, times the
    recent requests' mean duration (1 to 60)."""
    s = self.scheduler
    rounds = max(1.0, s.queued / s.runner.slots)
    return int(min(60, max(1, math.ceil(rounds * self.metrics.typical_duration()))))


def page() -> str:
  """The chat page's HTML."""
  return resources.files("q8rules.serve").joinpath("static/index.html").read_text("utf-8")


ERRORS: dict[int | str, dict[str, Any]] = {
  400: {"model": P.ErrorBody, "description": "an invalid request"},
  401: {"model": P.ErrorBody, "description": "no API key, or a wrong one (with --api-key)"},
  404: {"model": P.ErrorBody, "description": "a model other than the one served"},
  413: {"model": P.ErrorBody, "description": "a body over the limit"},
  415: {"model": P.ErrorBody, "description": "a body that is not JSON"},
  503: {"model": P.ErrorBody, "description": "full (Retry-After), past the timeout, or stopped"},
}
"""The error responses of the POST endpoints, for the OpenAPI schema."""

COMPLETION_OK = {
  200: {
    "description": "the completion (JSON), or with stream: true server-sent events",
    "content": {"application/json": {}, "text/event-stream": {}},
  }
}


def create_app(
  api: API,
  api_key: str | None = None,
  *,
  max_body: int = MAX_BODY,
  max_active: int | None = None,
  cors: list[str] | None = None,
) -> ASGIApp:
  """The ASGI app over `api`, behind `guards`' middleware.

  Args:
    api: the endpoints.
    api_key: when given, every path but `guards.PUBLIC` needs `Authorization: Bearer KEY`.
    max_body: the largest request body (bytes; 413 past it).
    max_active: the most completion requests at once, running or waiting (503 with
      Retry-After past it; None: no limit).
    cors: origins allowed to call the API from a browser page (None: no CORS headers at all).
  """
  app = FastAPI(
    title="q8rules serve", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json"
  )

  def failed(e: P.APIError) -> JSONResponse:
    api.count_error(e.status)
    return error_response(e)

  @app.exception_handler(P.APIError)
  async def _api_error(_: HTTPRequest, e: P.APIError) -> JSONResponse:
    return failed(e)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    return failed(P.validation_error(list(e.errors())))

  @app.exception_handler(StarletteHTTPException)
  async def _http(_: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
    message = str(e.detail)
    if e.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's
      message = "the request body is not JSON that can be read (not UTF-8, nested too deeply, or a number too long)"  # fmt: skip
    return failed(P.APIError(e.status_code, message, headers=dict(e.headers or {})))

  @app.exception_handler(Exception)
  async def _crash(http: HTTPRequest, e: Exception) -> JSONResponse:
    log.error("%s %s failed", http.method, http.url.path, exc_info=e)
    return failed(P.APIError(500, f"the server failed: {type(e).__name__}: {e}"))

  @app.post("/v1/chat/completions", response_model=None, responses={**COMPLETION_OK, **ERRORS})
  async def chat(body: P.ChatCompletionRequest, http: HTTPRequest) -> Response:
    """A chat completion through the model's chat template."""
    return await api.complete(http, body, chat=True)

  @app.post("/v1/completions", response_model=None, responses={**COMPLETION_OK, **ERRORS})
  async def completions(body: P.CompletionRequest, http: HTTPRequest) -> Response:
    """A text completion of a prompt (text or token ids)."""
    return await api.complete(http, body, chat=False)

  @app.get("/v1/models", responses={401: ERRORS[401]})
  async def models() -> dict[str, Any]:
    """The one model served."""
    return api.models()

  @app.get("/health", responses={503: {"description": "the engine is not running"}})
  async def health() -> JSONResponse:
    """200 while the engine runs, 503 once it has stopped or failed."""
    status, body = api.health()
    return JSONResponse(body, status_code=status)

  @app.get("/metrics", response_class=Response, responses={401: ERRORS[401]})
  async def metrics() -> Response:
    """Prometheus metrics."""
    content, media_type = api.metrics.exposition()
    return Response(content, media_type=media_type)

  @app.post("/tokenize", responses=ERRORS)
  async def tokenize(body: P.TokenizeRequest) -> dict[str, Any]:
    """llama-server's: the token ids of `content`."""
    return await run_in_threadpool(api.tokenize, body)

  @app.post("/detokenize", responses=ERRORS)
  async def detokenize(body: P.DetokenizeRequest) -> dict[str, Any]:
    """llama-server's: the text of `tokens`."""
    return await run_in_threadpool(api.detokenize, body)

  @app.get("/", response_class=HTMLResponse, include_in_schema=False)
  async def index() -> HTMLResponse:
    return HTMLResponse(page())

  def openapi() -> dict[str, Any]:
    """FastAPI's schema without its 422 (invalid requests get 400, OpenAI's status)."""
    if app.openapi_schema is None:
      schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
      for path in schema.get("paths", {}).values():
        for operation in path.values():
          operation.get("responses", {}).pop("422", None)
      for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
      app.openapi_schema = schema
    return app.openapi_schema

  app.openapi = openapi
  outer: ASGIApp = PostBody(app, max_body, api.count_error)
  if max_active is not None:
    outer = Admission(outer, max_active, api.retry_after, api.count_error)
  outer = KeyCheck(outer, api_key, api.count_error)
  if cors:
    outer = CORSMiddleware(
      outer, allow_origins=cors, allow_methods=["GET", "POST"],
      allow_headers=["Authorization", "Content-Type"],
    )  # fmt: skip
  return outer


__all__ = ["API", "ERRORS", "GONE", "MAX_BODY", "create_app", "error_response", "page", "sse"]
