"""The HTTP API: OpenAI's completions endpoints and llama-server's extras, on FastAPI.

  POST /v1/chat/completions   chat through the file's chat template; streamed (server-sent
                              events, as OpenAI's) with "stream": true
  POST /v1/completions        text (or token ids) in, text out; streamed likewise
  GET  /v1/models             the one model served
  GET  /health                {"status": "ok", ...} (no key needed)
  GET  /metrics               Prometheus text: requests, tokens in and out, queue depth,
                              decode tokens/s
  POST /tokenize, /detokenize llama-server's
  GET  /                      a chat page (static HTML and JS; no key needed)

Every error is OpenAI's JSON body (`protocol.APIError`) with its status: 400 for a malformed or
invalid request (JSON, fields, ranges, a prompt past the context, a template that fails to
render), 401 for a missing or wrong key when the server has one, 404 for an unknown model or
path, 413 for a body over the limit, 503 once the server is stopping. A client that disconnects
cancels its request: the engine frees its slot at its next turn.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp, Receive, Scope, Send

from q8rules.serve import protocol as P
from q8rules.serve.scheduler import DoneEvent, ErrorEvent, Request, Scheduler, TokenEvent

MAX_BODY = 4 << 20
"""The largest request body read (bytes); a larger one gets 413."""

PUBLIC = ("/", "/health")
"""Paths that need no key when the server has one."""

POLL_S = 0.5
"""How often a non-streamed request waiting for its tokens checks that its client is there."""


class KeyCheck:
  """ASGI middleware: with a key, every path but `PUBLIC` needs `Authorization: Bearer KEY`
  (401 with OpenAI's error body otherwise)."""

  def __init__(self, app: ASGIApp, api_key: str | None):
    self.app = app
    self.api_key = api_key

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http" or self.api_key is None or scope["path"] in PUBLIC:
      await self.app(scope, receive, send)
      return
    headers = dict(scope["headers"])
    given = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = given.partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), self.api_key):
      await self.app(scope, receive, send)
      return
    message = "no API key given" if not given else "the API key is wrong"
    error = P.APIError(401, f"{message}: send 'Authorization: Bearer KEY'", code="invalid_api_key")
    await JSONResponse(error.body(), status_code=401)(scope, receive, send)


def error_response(e: P.APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status)


def sse(data: Any) -> str:
  """One server-sent event carrying `data` as JSON (or the literal '[DONE]')."""
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def read_json(request: HTTPRequest, kind: type[BaseModel], max_body: int) -> Any:
  """The body of `request` as a `kind`, read up to `max_body` bytes.

  Raises:
    APIError: 413 for a larger body, 400 for malformed JSON or a field that fails validation
      (naming the field).
  """
  length = request.headers.get("content-length")
  if length is not None and length.isdigit() and int(length) > max_body:
    raise P.APIError(413, f"the request body is {length} bytes; the limit is {max_body}")
  chunks, size = [], 0
  async for piece in request.stream():
    size += len(piece)
    if size > max_body:
      raise P.APIError(413, f"the request body exceeds the limit of {max_body} bytes")
    chunks.append(piece)
  try:
    data = json.loads(b"".join(chunks) or b"null")
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise P.APIError(400, f"the request body is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise P.APIError(400, "the request body must be a JSON object")
  try:
    return kind.model_validate(data)
  except ValidationError as e:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    raise P.APIError(
      400, f"{param}: {first['msg']}" if param else first["msg"], param=param
    ) from None


class API:
  """The endpoints over one model and its engine.

  Args:
    model: the `GGUFModel` served (its tokenizer, chat template and config).
    scheduler: the engine (`q8rules.serve.scheduler.Scheduler`), started.
    name: the model's id in `/v1/models` and in responses; a request naming another model
      gets 404.
    max_body: the largest request body, bytes.
  """

  def __init__(self, model: Any, scheduler: Scheduler, name: str, max_body: int = MAX_BODY):
    self.model = model
    self.scheduler = scheduler
    self.name = name
    self.max_body = max_body
    self.context = scheduler.runner.context
    self.http_errors: dict[int, int] = {}
    tok = model.tokenizer
    self.stop_ids = frozenset(tok.eog_ids) if tok is not None else frozenset()

  # --- checks ---------------------------------------------------------------------------------

  def check_model(self, model: str | None) -> None:
    names = {self.name, Path(self.name).stem, ""}
    if model is not None and model not in names:
      raise P.APIError(
        404, f"the model '{model}' is not served here; this server serves '{self.name}'",
        param="model", code="model_not_found",
      )  # fmt: skip

  def tokenizer(self) -> Any:
    if self.model.tokenizer is None:
      raise P.APIError(400, f"{self.name}: no tokenizer could be built; send token ids")
    return self.model.tokenizer

  def check_ids(self, ids: list[int], limit: int | None) -> int:
    """The number of tokens to generate: `limit`, or what the context leaves (APIError 400
    when the prompt and `limit` do not fit the context, or an id is outside the vocabulary)."""
    if not ids:
      raise P.APIError(400, "the prompt is empty", param="prompt")
    vocab = self.model.config.vocab
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
      raise P.APIError(400, f"token ids {bad[:5]} lie outside [0, {vocab})", param="prompt")
    if len(ids) >= self.context:
      raise P.APIError(
        400, f"the prompt's {len(ids)} tokens fill the context of {self.context} tokens;"
        " nothing is left to generate", param="messages", code="context_length_exceeded",
      )  # fmt: skip
    if limit is None:
      return self.context - len(ids)
    if len(ids) + limit > self.context:
      raise P.APIError(
        400, f"the prompt's {len(ids)} tokens and max_tokens {limit} exceed the context of"
        f" {self.context} tokens", param="max_tokens", code="context_length_exceeded",
      )  # fmt: skip
    return limit

  # --- completions ----------------------------------------------------------------------------

  def chat_ids(self, body: P.ChatCompletionRequest) -> list[int]:
    from q8rules.llm.chat import ChatTemplateError

    self.tokenizer()
    messages = [m.as_template_input() for m in body.messages]
    try:
      return list(self.model.apply_chat_template(messages, add_generation_prompt=True))
    except ChatTemplateError as e:
      raise P.APIError(400, str(e), param="messages", code="template_error") from None
    except ValueError as e:  # a message the renderer refuses
      raise P.APIError(400, str(e), param="messages") from None

  def completion_ids(self, body: P.CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
      tok = self.tokenizer()
      return tok.encode(body.prompt) or ([tok.bos_id] if tok.bos_id is not None else [])
    return list(body.prompt)

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

  async def run(
    self, http: HTTPRequest, body: Any, ids: list[int], chat: bool
  ) -> StreamingResponse | JSONResponse:
    self.check_model(body.model)
    limit = self.check_ids(ids, body.limit())
    want, top = body.logprob_settings()
    try:
      params = body.sampling(secrets.randbits(31), want, top)
    except ValueError as e:
      raise P.APIError(400, str(e)) from None
    queue, emit = Request.queue_for(asyncio.get_running_loop())
    stop_ids = frozenset() if body.ignore_eos else self.stop_ids
    request = Request(ids, limit, params, body.stops(), stop_ids, emit)
    try:
      self.scheduler.submit(request)
    except RuntimeError as e:
      raise P.APIError(503, str(e)) from None
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
      return StreamingResponse(
        self.stream(request, queue, rid, chat, body.include_usage()),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
      )
    return await self.whole(http, request, queue, rid, chat, want)

  def _cancel(self, request: Request) -> None:
    request.cancel()
    self.scheduler.wake()

  async def whole(
    self,
    http: HTTPRequest,
    request: Request,
    queue: asyncio.Queue,
    rid: str,
    chat: bool,
    want: bool,
  ) -> JSONResponse:
    text, entries = [], []
    try:
      while True:
        try:
          event = await asyncio.wait_for(queue.get(), POLL_S)
        except asyncio.TimeoutError:
          if await http.is_disconnected():
            self._cancel(request)
            return JSONResponse({}, status_code=499)
          continue
        if isinstance(event, TokenEvent):
          text.append(event.text)
          entries.extend(self.logprob_entries(event.logprobs or []))
        elif isinstance(event, ErrorEvent):
          return error_response(P.APIError(event.status, event.message))
        else:
          break
    except asyncio.CancelledError:
      self._cancel(request)
      raise
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
    self, request: Request, queue: asyncio.Queue, rid: str, chat: bool, include_usage: bool
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

  def health(self) -> dict[str, Any]:
    s = self.scheduler
    return {
      "status": "ok",
      "slots_idle": s.runner.slots - s.running,
      "slots_processing": s.running,
      "requests_waiting": s.queued,
    }

  def metrics(self) -> str:
    s, m = self.scheduler, self.scheduler.metrics
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
      lines.extend([f"# HELP q8rules_{name} {help}", f"# TYPE q8rules_{name} {kind}"])
      lines.extend(f"q8rules_{name}{labels} {value}" for labels, value in samples)

    ended = sorted(m.requests.items()) or [("stop", 0)]
    metric("requests_total", "counter", "Requests ended, by how they ended.",
           [(f'{{finish_reason="{k}"}}', v) for k, v in ended])  # fmt: skip
    metric("prompt_tokens_total", "counter", "Prompt tokens taken in.", [("", m.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", m.generated_tokens)])
    metric("decode_steps_total", "counter", "Decode steps run.", [("", m.decode_steps)])
    metric("requests_running", "gauge", "Requests holding a slot.", [("", s.running)])
    metric("requests_waiting", "gauge", "Requests queued for a slot.", [("", s.queued)])
    metric("slots", "gauge", "Slots of the batched KV cache.", [("", s.runner.slots)])
    metric("decode_tokens_per_second", "gauge", "Tokens/s of the recent decode steps.",
           [("", round(m.decode_rate(), 3))])  # fmt: skip
    errors = sorted(self.http_errors.items()) or [(400, 0)]
    metric("http_errors_total", "counter", "Error responses, by status.",
           [(f'{{status="{k}"}}', v) for k, v in errors])  # fmt: skip
    return "\n".join(lines) + "\n"


def page() -> str:
  """The chat page's HTML."""
  return resources.files("q8rules.serve").joinpath("static/index.html").read_text("utf-8")


def create_app(api: API, api_key: str | None = None) -> ASGIApp:
  """The ASGI app over `api` (with `api_key`: the key check in front)."""
  app = FastAPI(title="q8rules serve", docs_url=None, redoc_url=None, openapi_url=None)

  def failed(e: P.APIError) -> JSONResponse:
    api.http_errors[e.status] = api.http_errors.get(e.status, 0) + 1
    return error_response(e)

  @app.exception_handler(P.APIError)
  async def _api_error(_: HTTPRequest, e: P.APIError) -> JSONResponse:
    return failed(e)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    return failed(P.APIError(400, str(e)))

  @app.exception_handler(StarletteHTTPException)
  async def _http(_: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
    return failed(P.APIError(e.status_code, str(e.detail)))

  @app.exception_handler(Exception)
  async def _crash(_: HTTPRequest, e: Exception) -> JSONResponse:
    return failed(P.APIError(500, f"the server failed: {type(e).__name__}: {e}"))

  @app.post("/v1/chat/completions")
  async def chat(http: HTTPRequest) -> Any:
    body = await read_json(http, P.ChatCompletionRequest, api.max_body)
    api.check_model(body.model)
    return await api.run(http, body, api.chat_ids(body), chat=True)

  @app.post("/v1/completions")
  async def completions(http: HTTPRequest) -> Any:
    body = await read_json(http, P.CompletionRequest, api.max_body)
    api.check_model(body.model)
    return await api.run(http, body, api.completion_ids(body), chat=False)

  @app.get("/v1/models")
  async def models() -> dict[str, Any]:
    return api.models()

  @app.get("/health")
  async def health() -> dict[str, Any]:
    return api.health()

  @app.get("/metrics")
  async def metrics() -> PlainTextResponse:
    return PlainTextResponse(api.metrics(), media_type="text/plain; version=0.0.4")

  @app.post("/tokenize")
  async def tokenize(http: HTTPRequest) -> dict[str, Any]:
    body = await read_json(http, P.TokenizeRequest, api.max_body)
    tok = api.tokenizer()
    ids = tok.encode(body.content, add_special=body.add_special, parse_special=True)
    if not body.with_pieces:
      return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": tok.decode([i], special=True)} for i in ids]}

  @app.post("/detokenize")
  async def detokenize(http: HTTPRequest) -> dict[str, Any]:
    body = await read_json(http, P.DetokenizeRequest, api.max_body)
    try:
      return {"content": api.tokenizer().decode(body.tokens)}
    except ValueError as e:
      raise P.APIError(400, str(e), param="tokens") from None

  @app.get("/")
  async def index() -> HTMLResponse:
    return HTMLResponse(page())

  return KeyCheck(app, api_key)


__all__ = ["API", "MAX_BODY", "PUBLIC", "KeyCheck", "create_app", "page", "read_json", "sse"]
