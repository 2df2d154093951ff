"""OpenAI-style errors: the exception the API answers with, its body's schema, and pydantic's
validation errors read as one 400 that names the field.

  {"error": {"message": "top_p: ...", "type": "invalid_request_error", "param": "top_p",
             "code": null}}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class APIError(Exception):
  """An error the API answers with OpenAI's error body.

  Args:
    status: the HTTP status (400 bad request, 401 no or wrong key, 404 unknown model or path,
      413 body too large, 415 not JSON, 500 the server failed, 503 full or stopping).
    message: what went wrong, for the client.
    type: OpenAI's error type (defaults by status).
    param: the request field at fault, or None.
    code: a short machine-readable code, or None.
    headers: extra response headers (`Retry-After` on a 503).
  """

  TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
  }

  def __init__(
    self,
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
  ):
    super().__init__(message)
    self.status = status
    self.message = message
    self.type = type or self.TYPES.get(status, "invalid_request_error")
    self.param = param
    self.code = code
    self.headers = headers or {}

  def body(self) -> dict[str, Any]:
    """OpenAI's error body."""
    return {
      "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
    }


class ErrorDetail(BaseModel):
  """What an error body holds (OpenAI's)."""

  message: str
  type: str
  param: str | None
  code: str | None


class ErrorBody(BaseModel):
  """OpenAI's error body, for the OpenAPI schema: every error response is one."""

  error: ErrorDetail


_TYPE_TAGS = ("str", "int", "float", "bool", "none", "list", "dict")


def _field_path(loc: tuple[Any, ...]) -> list[str]:
  """A pydantic error's location as the request's field path: FastAPI's 'body' dropped, and
  the tags pydantic adds for a union's member ('str', 'list[int]', 'function-after[...]')."""
  out = [str(p) for p in loc]
  if out and out[0] == "body":
    out = out[1:]
  return [p for p in out if p not in _TYPE_TAGS and "[" not in p and "(" not in p]


def validation_error(errors: list[dict[str, Any]]) -> APIError:
  """The 400 for pydantic's `errors`: the field's dotted path as `param` and at the head of the
  message ('messages.0.role: ...'; a check across fields gives its field as `ctx["field"]`). Of a union's alternatives, the error that reached deepest
  into the value is the one told (a content part's wrong type, not "not a string")."""
  if not errors:
    return APIError(400, "the request is invalid")
  first = max(errors, key=lambda e: len(_field_path(tuple(e.get("loc", ())))))
  loc = _field_path(tuple(first.get("loc", ())))
  message = str(first.get("msg", "the request is invalid"))
  field = (first.get("ctx") or {}).get("field")  # a check across fields names its own
  if field:
    loc.append(str(field))
    message = message.removeprefix(f"{field}: ")
  param = ".".join(loc) or None
  if first.get("type") == "json_invalid":
    error = (first.get("ctx") or {}).get("error", "")
    return APIError(400, f"the request body is not valid JSON: {error or message}")
  if first.get("type") in ("model_attributes_type", "dict_type") and param is None:
    return APIError(400, "the request body must be a JSON object")
  if first.get("type") == "missing" and param is None:
    return APIError(400, "the request body is empty; a JSON object is needed")
  return APIError(400, f"{param}: {message}" if param else message, param=param)


__all__ = ["APIError", "ErrorBody", "ErrorDetail", "validation_error"]
