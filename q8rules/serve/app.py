"""The ASGI app: OpenAI's completions endpoints and llama-server's extras on FastAPI, over
`api.API`.

  POST /v1/chat/completions   chat through the file's chat template; streamed (server-sent
                              events, as OpenAI's) with "stream": true
  POST /v1/completions        text (or token ids) in, text out; streamed likewise
  GET  /v1/models             the one model served
  GET  /health                200 {"status": "ok", ...} while the engine runs, else 503
                              (no key needed)
  GET  /metrics               Prometheus text (`q8rules.engine.metrics`)
  POST /tokenize, /detokenize llama-server's
  GET  /openapi.json          the OpenAPI schema of all of these (no key needed)
  GET  /                      a chat page (static HTML and JS; no key needed)

The handlers take typed bodies (`protocol`'s pydantic models), so FastAPI validates them and
`/openapi.json` describes them. Every error is OpenAI's JSON body (`errors.APIError`) with its
status: 400 for a malformed or invalid request (JSON, fields, ranges, a prompt past the
context, a template that fails to render), 401 for a missing or wrong key when the server has
one, 404 for an unknown model or path, 413 for a body over the limit, 415 for a body that is
not JSON, 500 when the server fails on a request, 503 when it is full (`Retry-After`), a
request runs past its timeout, or the engine has stopped. `guards` runs before the handlers.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp

from q8rules.serve import protocol as P
from q8rules.serve.api import API, MAX_BODY
from q8rules.serve.errors import APIError, ErrorBody, validation_error
from q8rules.serve.guards import Admission, KeyCheck, PostBody

log = logging.getLogger("q8rules.serve")


class ASCIIJSONResponse(JSONResponse):
  """JSON with every non-ASCII character escaped: an error may quote what the client sent,
  and text with an unpaired surrogate has no UTF-8 bytes."""

  def render(self, content: Any) -> bytes:
    return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(e: P.APIError) -> JSONResponse:
  return ASCIIJSONResponse(e.body(), status_code=e.status, headers=e.headers)


def page() -> str:
  """The chat page's HTML."""
  return resources.files("q8rules.serve").joinpath("static/index.html").read_text("utf-8")


ERRORS: dict[int | str, dict[str, Any]] = {
  400: {"model": ErrorBody, "description": "an invalid request"},
  401: {"model": ErrorBody, "description": "no API key, or a wrong one (with --api-key)"},
  404: {"model": ErrorBody, "description": "a model other than the one served"},
  413: {"model": ErrorBody, "description": "a body over the limit"},
  415: {"model": ErrorBody, "description": "a body that is not JSON"},
  503: {"model": ErrorBody, "description": "full (Retry-After), past the timeout, or stopped"},
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

  def failed(e: APIError) -> JSONResponse:
    api.count_error(e.status)
    return error_response(e)

  @app.exception_handler(APIError)
  async def _api_error(_: HTTPRequest, e: APIError) -> JSONResponse:
    return failed(e)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    return failed(validation_error(list(e.errors())))

  @app.exception_handler(StarletteHTTPException)
  async def _http(_: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
    message = str(e.detail)
    if e.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's
      message = "the request body is not JSON that can be read (not UTF-8, nested too deeply, or a number too long)"  # fmt: skip
    return failed(APIError(e.status_code, message, headers=dict(e.headers or {})))

  @app.exception_handler(Exception)
  async def _crash(http: HTTPRequest, e: Exception) -> JSONResponse:
    log.error("%s %s failed", http.method, http.url.path, exc_info=e)
    return failed(APIError(500, f"the server failed: {type(e).__name__}: {e}"))

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


__all__ = ["COMPLETION_OK", "ERRORS", "create_app", "error_response", "page"]
