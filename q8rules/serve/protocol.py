"""The OpenAI-compatible request and response shapes, their checks, and OpenAI-style errors.

Requests are pydantic models: a field of the wrong type, out of range or missing fails
validation, and the API answers 400 with OpenAI's error body:

  {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Unknown fields are ignored (clients send many). Responses are plain dicts built here
(`completion`, `chunk`), as OpenAI returns them: `id`, `object`, `created`, `model`, `choices`
(with `finish_reason` and, when asked for, `logprobs`) and `usage`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from q8rules.serve.sampling import HISTORY, MAX_TOP_LOGPROBS, SamplingParams

MAX_STOP = 4
"""At most this many stop strings (OpenAI's limit)."""

SAMPLING_FIELDS = (
  "temperature",
  "top_p",
  "top_k",
  "min_p",
  "repeat_penalty",
  "frequency_penalty",
  "presence_penalty",
)
"""The request's fields that `SamplingParams` takes under the same names."""


class APIError(Exception):
  """An error the API answers with OpenAI's error body.

  Args:
    status: the HTTP status (400 bad request, 401 no or wrong key, 404 unknown model or path,
      413 body too large, 500 the server failed, 503 shutting down).
    message: what went wrong, for the client.
    type: OpenAI's error type (defaults by status).
    param: the request field at fault, or None.
    code: a short machine-readable code, or None.
  """

  TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
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
  ):
    super().__init__(message)
    self.status = status
    self.message = message
    self.type = type or self.TYPES.get(status, "invalid_request_error")
    self.param = param
    self.code = code

  def body(self) -> dict[str, Any]:
    """OpenAI's error body."""
    return {
      "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
    }


class _Request(BaseModel):
  """What chat and text completions share: the model and the sampling settings."""

  model_config = ConfigDict(extra="ignore")

  model: str | None = None
  max_tokens: int | None = Field(default=None, gt=0)
  temperature: float = Field(default=1.0, ge=0)
  top_p: float = Field(default=1.0, gt=0, le=1)
  top_k: int = Field(default=0, ge=0)
  min_p: float = Field(default=0.0, ge=0, le=1)
  seed: int | None = None
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: dict[str, Any] | None = None
  frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
  presence_penalty: float = Field(default=0.0, ge=-2, le=2)
  repeat_penalty: float = Field(default=1.0, gt=0)
  repeat_last_n: int = Field(default=HISTORY, ge=0, le=HISTORY)
  ignore_eos: bool = False
  n: int = Field(default=1, ge=1, le=1)

  @field_validator("stop")
  @classmethod
  def _stop(cls, v: str | list[str] | None) -> list[str]:
    stops = [] if v is None else [v] if isinstance(v, str) else list(v)
    if len(stops) > MAX_STOP:
      raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
    return stops

  def stops(self) -> list[str]:
    return list(self.stop or [])

  def include_usage(self) -> bool:
    return bool((self.stream_options or {}).get("include_usage"))

  def sampling(self, seed: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """The request's `SamplingParams` (`seed` when it gives none)."""
    return SamplingParams(
      **{name: getattr(self, name) for name in SAMPLING_FIELDS},
      penalty_last_n=self.repeat_last_n,
      seed=self.seed if self.seed is not None else seed,
      logprobs=logprobs,
      top_logprobs=top_logprobs,
    )


class ContentPart(BaseModel):
  """A part of a message's content: only text parts are read."""

  model_config = ConfigDict(extra="ignore")

  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  """One message: a role and its content (a string, or a list of text parts)."""

  model_config = ConfigDict(extra="ignore")

  role: str
  content: str | list[ContentPart] | None = None

  def as_template_input(self) -> dict[str, Any]:
    content = self.content
    if isinstance(content, list):
      content = "".join(p.text for p in content)
    return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
  """`POST /v1/chat/completions`."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(default=None, gt=0)
  logprobs: bool = False
  top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

  def limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

  def logprob_settings(self) -> tuple[bool, int]:
    return self.logprobs, (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Request):
  """`POST /v1/completions`: `prompt` a string, or token ids."""

  prompt: str | list[int] | list[str] = Field(min_length=1)
  max_tokens: int | None = Field(default=16, gt=0)
  logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  echo: bool = False

  @field_validator("prompt")
  @classmethod
  def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
    if isinstance(v, list) and v and isinstance(v[0], str):
      if len(v) != 1:
        raise ValueError("one prompt per request (a list of several strings is not served)")
      return v[0]
    return v

  def limit(self) -> int | None:
    return self.max_tokens

  def logprob_settings(self) -> tuple[bool, int]:
    return self.logprobs is not None, self.logprobs or 0


class TokenizeRequest(BaseModel):
  """`POST /tokenize` (llama-server's): the ids of `content`."""

  model_config = ConfigDict(extra="ignore")

  content: str
  add_special: bool = False
  with_pieces: bool = False


class DetokenizeRequest(BaseModel):
  """`POST /detokenize` (llama-server's): the text of `tokens`."""

  model_config = ConfigDict(extra="ignore")

  tokens: list[int]


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
  return {
    "prompt_tokens": prompt,
    "completion_tokens": completion,
    "total_tokens": prompt + completion,
  }


def base(kind: str, rid: str, model: str) -> dict[str, Any]:
  return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
  """Chat's `logprobs`: {'content': [{'token', 'logprob', 'bytes', 'top_logprobs'}]}."""
  return {"content": entries}


def completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
  """Text completions' legacy `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
  offsets, at = [], offset
  for e in entries:
    offsets.append(at)
    at += len(e["token"])
  return {
    "tokens": [e["token"] for e in entries],
    "token_logprobs": [e["logprob"] for e in entries],
    "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
    "text_offset": offsets,
  }


__all__ = [
  "APIError",
  "ChatCompletionRequest",
  "ChatMessage",
  "CompletionRequest",
  "DetokenizeRequest",
  "MAX_STOP",
  "SAMPLING_FIELDS",
  "TokenizeRequest",
  "base",
  "chat_logprobs",
  "completion_logprobs",
  "new_id",
  "usage",
]
