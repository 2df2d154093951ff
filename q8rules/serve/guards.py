"""ASGI middleware in front of the API: what a request must pass before a handler sees it.

  KeyCheck     with a key, every path but `PUBLIC` needs `Authorization: Bearer KEY` (401)
  PostBody     a POST's body (to a path that takes one) is JSON (`Content-Type:
               application/json`, else 415) and at most `max_body` bytes (413); it is read
               here, then handed to the app whole
  Admission    at most `limit` completion requests at once (running, waiting for a slot, or
               being tokenized); past it 503 with `Retry-After`, before the body is read

Each answers with OpenAI's error body (`errors.APIError`) and reports its status to `count`
(the metrics' error counter). Requiring JSON on POST also keeps browsers' cross-site "simple"
requests (forms, text/plain, sent without a CORS preflight) out.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from q8rules.serve.errors import APIError

PUBLIC = ("/", "/health", "/openapi.json")
"""Paths that need no key when the server has one."""

COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
"""The paths `Admission` counts."""

JSON_POSTS = (*COMPLETIONS, "/tokenize", "/detokenize")
"""The paths that take a JSON body (a POST elsewhere gets the app's 405 or 404)."""

Count = Callable[[int], None]


async def send_error(error: APIError, send: Send) -> None:
  """Answer with `error` (its body, status and headers) as the whole response."""
  body = json.dumps(error.body()).encode()
  headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
  headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
  await send({"type": "http.response.start", "status": error.status, "headers": headers})
  await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
  for key, value in scope.get("headers", ()):
    if key.lower() == name:
      return value.decode("latin-1")
  return None


class KeyCheck:
  """With `api_key`, every path but `PUBLIC` (and CORS preflights) needs
  `Authorization: Bearer KEY`: 401 with OpenAI's error body otherwise."""

  def __init__(self, app: ASGIApp, api_key: str | None, count: Count):
    self.app = app
    self.api_key = api_key
    self.count = count

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if (
      scope["type"] != "http"
      or self.api_key is None
      or scope["path"] in PUBLIC
      or scope["method"] == "OPTIONS"
    ):
      await self.app(scope, receive, send)
      return
    given = _header(scope, b"authorization") or ""
    scheme, _, token = given.partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(
      token.strip().encode("latin-1"), self.api_key.encode()
    ):
      await self.app(scope, receive, send)
      return
    message = "no API key given" if not given else "the API key is wrong"
    self.count(401)
    error = APIError(401, f"{message}: send 'Authorization: Bearer KEY'", code="invalid_api_key")
    await send_error(error, send)


def is_json(content_type: str | None) -> bool:
  """Whether `content_type` is JSON: application/json or application/*+json (parameters such
  as charset allowed)."""
  if not content_type:
    return False
  kind = content_type.split(";", 1)[0].strip().lower()
  return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class PostBody:
  """A POST's body to one of `JSON_POSTS` must be JSON (415 otherwise) and at most `max_body`
  bytes (413): it is read whole here (a Content-Length over the limit is refused before
  reading), then the app gets it as one message; later `receive` calls go to the server (a
  disconnect)."""

  def __init__(self, app: ASGIApp, max_body: int, count: Count):
    self.app = app
    self.max_body = max_body
    self.count = count

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in JSON_POSTS:
      await self.app(scope, receive, send)
      return
    content_type = _header(scope, b"content-type")
    if not is_json(content_type):
      self.count(415)
      what = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
      message = f"the body must be JSON (Content-Type: application/json); got {what}"
      await send_error(APIError(415, message), send)
      return
    length = _header(scope, b"content-length")
    if length is not None and length.strip().isdigit() and int(length) > self.max_body:
      await self._too_large(f"the request body is {int(length)} bytes", send)
      return
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return  # the client left before its body was in
      chunk = message.get("body", b"")
      size += len(chunk)
      if size > self.max_body:
        await self._too_large("the request body exceeds that", send)
        return
      chunks.append(chunk)
      if not message.get("more_body", False):
        break
    whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def replay() -> Message:
      nonlocal whole
      if whole is not None:
        message, whole = whole, None
        return message
      return await receive()

    await self.app(scope, replay, send)

  async def _too_large(self, what: str, send: Send) -> None:
    self.count(413)
    await send_error(APIError(413, f"{what}; the limit is {self.max_body} bytes"), send)


class Admission:
  """At most `limit` completion requests (`COMPLETIONS`) at once; past it, 503 with
  `Retry-After: retry_after()` seconds, before the body is read. A request counts from its
  arrival to the end of its response (a stream's last event)."""

  def __init__(self, app: ASGIApp, limit: int, retry_after: Callable[[], int], count: Count):
    self.app = app
    self.limit = limit
    self.retry_after = retry_after
    self.count = count
    self.active = 0

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http" or scope["path"] not in COMPLETIONS or scope["method"] != "POST":
      await self.app(scope, receive, send)
      return
    if self.active >= self.limit:
      self.count(503)
      seconds = self.retry_after()
      error = APIError(
        503, f"the server is full ({self.active} requests running or waiting, its limit);"
        f" retry after {seconds} s", code="server_overloaded",
        headers={"Retry-After": str(seconds)},
      )  # fmt: skip
      await send_error(error, send)
      return
    self.active += 1
    try:
      await self.app(scope, receive, send)
    finally:
      self.active -= 1


__all__ = [
  "COMPLETIONS",
  "JSON_POSTS",
  "PUBLIC",
  "Admission",
  "KeyCheck",
  "PostBody",
  "is_json",
  "send_error",
]
