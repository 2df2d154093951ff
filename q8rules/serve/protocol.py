"""The OpenAI-compatible requests: their shapes and their checks.

Requests are pydantic models, the handlers' typed bodies (so `/openapi.json` describes them),
in strict mode: a field is the JSON type the schema says (16, not "16", 16.0 or true, for an
integer). A field of the wrong type, out of its range or missing fails validation, and the API
answers 400 with OpenAI's error body naming the field:

  {"error": {"message": "top_p: ...", "type": "invalid_request_error", "param": "top_p",
             "code": null}}

Every number has a range (`docs/serve.md` lists them): what the sampling chain can compute in
float32 without an infinity or a NaN, OpenAI's where OpenAI has one. `seed` takes any JSON
integer and keeps its low 32 bits, as llama-server reads it into a uint32 (-1 is 4294967295).
What depends on the model (`top_k` and `logit_bias` ids within the vocabulary, the prompt and
`max_tokens` within the context) is checked by the API (`q8rules.serve.api`).

Structured output: `response_format` (OpenAI's `json_object` and `json_schema`) and
llama-server's `grammar` (GBNF) and `json_schema` constrain the reply (the API compiles them
against the vocabulary: a bad one is a 400 naming its field). Tool calling: `tools` (functions
with JSON Schema parameters), `tool_choice` ("none", "auto", "required" or a named function)
and `parallel_tool_calls`; assistant messages may carry `tool_calls`, and `role: "tool"`
messages (with their `tool_call_id`) answer them. Fields that would change the
reply but are not implemented (`functions`, `audio`, ...: `UNSERVED`) are refused by name,
unless they hold the value that changes nothing (`"functions": []`). Other unknown
fields are ignored (clients send many: `user`, `store`, `metadata`). A field sent as null is
its default, as OpenAI reads it. The responses are `responses`'; the error body, `errors`'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from q8rules.engine.sampling import (
  HISTORY,
  MAX_LOGIT_BIAS,
  MAX_TOP_LOGPROBS,
  SEED_MODULUS,
  SamplingParams,
)
from q8rules.serve.tool_requests import MessageToolCall, NamedToolChoice, ToolDef

MAX_TOOLS = 128
"""At most this many tools a request (OpenAI's limit)."""

MAX_STOP = 4
"""At most this many stop strings (OpenAI's limit)."""

MAX_STOP_CHARS = 256
"""The longest stop string (characters): a request's text is searched for its stops at every
token, so their length is bounded."""

TEMPERATURE_MAX = 2.0
"""`temperature` is in [0, 2] (OpenAI's range)."""

REPEAT_PENALTY_RANGE = (0.01, 100.0)
"""`repeat_penalty` (llama.cpp's, which sets no range): a factor the float32 logits stay finite
under."""

LOGIT_BIAS_MAX = 100.0
"""A `logit_bias` value is in [-100, 100] (OpenAI's range)."""

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles served; 'developer' (OpenAI's newer name for 'system') reaches the chat
template as 'system'; 'tool' carries a tool's result back."""


UNSERVED: dict[str, tuple[Any, ...]] = {
  "functions": ([],),
  "function_call": ("none",),
  "audio": (),
  "modalities": (["text"],),
  "suffix": ("",),
  "echo": (False,),
  "best_of": (1,),
}
"""Fields that would change the reply, not implemented yet: refused by name (400) unless absent,
null, or the one value listed here that asks for nothing."""


def _refuse_unserved(name: str, value: Any) -> Any:
  """`value` if field `name` asks for nothing (absent, null or its neutral value); else the
  field's refusal."""
  if value is None or any(value == v for v in UNSERVED[name]):
    return value
  raise PydanticCustomError(
    "unsupported_field",
    "{name} is not supported by this server yet; leave it out (or null)",
    {"name": name},
  )


class JsonSchemaFormat(BaseModel):
  """`response_format.json_schema`: OpenAI's named schema (`strict` is always honoured: the
  reply is constrained to the schema token by token)."""

  model_config = ConfigDict(extra="forbid", strict=True)

  name: str | None = None
  description: str | None = None
  schema_: dict[str, Any] = Field(alias="schema")
  strict: bool | None = None


class ResponseFormat(BaseModel):
  """`response_format`: "text" (free), "json_object" (any JSON object) or "json_schema" (JSON
  valid for `json_schema.schema`)."""

  model_config = ConfigDict(extra="forbid", strict=True)

  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchemaFormat | None = None

  def as_request_field(self) -> dict[str, Any]:
    """The form `q8rules.llm.grammar.grammar_for_request` reads."""
    out: dict[str, Any] = {"type": self.type}
    if self.json_schema is not None:
      out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_}
    return out


def _float32_positive(name: str, v: float | None) -> float | None:
  """`v` unless float32 (the sampling step's type) makes it 0."""
  if v is not None and v > 0 and float(np.float32(v)) == 0:
    raise PydanticCustomError(
      "float32_zero", "{name} {v} is 0 in float32; use at least 1e-45", {"name": name, "v": v}
    )
  return v


class StreamOptions(BaseModel):
  """`stream_options`: `include_usage` adds a last chunk with the usage."""

  model_config = ConfigDict(extra="ignore", strict=True)

  include_usage: bool | None = None


class _Request(BaseModel):
  """What chat and text completions share: the model and the sampling settings (null: the
  default)."""

  model_config = ConfigDict(extra="ignore", strict=True)

  model: str | None = Field(default=None, description="the one model served (or left out)")
  max_tokens: int | None = Field(default=None, ge=1)
  temperature: float | None = Field(
    default=None, ge=0, le=TEMPERATURE_MAX, allow_inf_nan=False, description="default 1; 0: greedy"
  )
  top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
  top_k: int | None = Field(default=None, ge=0, description="0: off; at most the vocabulary")
  min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
  seed: int | None = Field(default=None, description="any integer; its low 32 bits are used")
  stop: str | list[str] | None = None
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
  presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
  repeat_penalty: float | None = Field(
    default=None, ge=REPEAT_PENALTY_RANGE[0], le=REPEAT_PENALTY_RANGE[1], allow_inf_nan=False
  )
  repeat_last_n: int | None = Field(default=None, ge=0, le=HISTORY)
  ignore_eos: bool | None = None
  n: int | None = Field(default=None, ge=1, le=1, description="one choice per request")
  logit_bias: (
    dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX, allow_inf_nan=False)]]
    | None
  ) = Field(  # fmt: skip
    default=None,
    max_length=MAX_LOGIT_BIAS,
    description="token id (a decimal string) -> a bias added to its logit, in [-100, 100]",
  )
  response_format: ResponseFormat | None = Field(
    default=None, description="text, json_object or json_schema: the reply constrained to it"
  )
  grammar: str | None = Field(
    default=None, description="llama-server's: a GBNF grammar the reply follows ('' : none)"
  )
  json_schema: dict[str, Any] | None = Field(
    default=None, description="llama-server's: a JSON Schema the reply follows"
  )

  def constraint(self) -> dict[str, Any]:
    """The structured-output fields set, as `grammar_for_request`'s keyword arguments."""
    out: dict[str, Any] = {}
    if self.response_format is not None and self.response_format.type != "text":
      out["response_format"] = self.response_format.as_request_field()
    if self.grammar:
      out["grammar"] = self.grammar
    if self.json_schema is not None:
      out["json_schema"] = self.json_schema
    return out

  @field_validator("top_p")
  @classmethod
  def _top_p(cls, v: float | None) -> float | None:
    return _float32_positive("top_p", v)

  @field_validator("seed")
  @classmethod
  def _seed(cls, v: int | None) -> int | None:
    return None if v is None else v % SEED_MODULUS

  @field_validator("stop")
  @classmethod
  def _stop(cls, v: str | list[str] | None) -> list[str]:
    stops = [] if v is None else [v] if isinstance(v, str) else list(v)
    if len(stops) > MAX_STOP:
      raise PydanticCustomError(
        "too_many_stops", "at most {n} stop strings, got {got}", {"n": MAX_STOP, "got": len(stops)}
      )
    if any(len(s) > MAX_STOP_CHARS for s in stops):
      raise PydanticCustomError(
        "stop_too_long", "a stop string is at most {n} characters", {"n": MAX_STOP_CHARS}
      )
    return stops

  @field_validator("logit_bias")
  @classmethod
  def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
    for key in v or {}:
      if not (key.isascii() and key.isdigit()) or len(key) > 12:
        raise PydanticCustomError(
          "logit_bias_key", "the key {key} is not a token id (a decimal number)", {"key": repr(key)}
        )
    return v

  def stops(self) -> list[str]:
    return list(self.stop or [])

  def include_usage(self) -> bool:
    return bool(self.stream_options is not None and self.stream_options.include_usage)

  def bias(self) -> dict[int, float]:
    """`logit_bias` as {token id: bias}."""
    return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

  def sampling(self, seed: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """The request's `SamplingParams` (`seed` when it gives none; a null field's default)."""

    def given(value: Any, default: Any) -> Any:
      return default if value is None else value

    return SamplingParams(
      temperature=given(self.temperature, 1.0),
      top_p=given(self.top_p, 1.0),
      top_k=given(self.top_k, 0),
      min_p=given(self.min_p, 0.0),
      repeat_penalty=given(self.repeat_penalty, 1.0),
      frequency_penalty=given(self.frequency_penalty, 0.0),
      presence_penalty=given(self.presence_penalty, 0.0),
      penalty_last_n=given(self.repeat_last_n, HISTORY),
      seed=given(self.seed, seed),
      logprobs=logprobs,
      top_logprobs=top_logprobs,
      logit_bias=tuple(sorted(self.bias().items())),
    )


class ContentPart(BaseModel):
  """A part of a message's content: only text parts are served."""

  model_config = ConfigDict(extra="ignore", strict=True)

  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  """One message: a role and its content (a string, or a list of text parts). An assistant
  message may carry `tool_calls` (its content then may be null); a `tool` message answers one
  (`tool_call_id`)."""

  model_config = ConfigDict(extra="ignore", strict=True)

  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
  name: str | None = None
  tool_calls: list[MessageToolCall] | None = None
  tool_call_id: str | None = None

  @field_validator("role", mode="before")
  @classmethod
  def _role(cls, v: Any) -> Any:
    if v == "function":
      raise PydanticCustomError(
        "unsupported_role",
        "'function' messages (OpenAI's deprecated form) are not served; answer a call with a"
        " 'tool' message and its tool_call_id",
      )
    if isinstance(v, str) and v not in ROLES:
      raise PydanticCustomError(
        "unknown_role",
        "{role} is not a role; one of {roles}",
        {"role": repr(v), "roles": ", ".join(ROLES)},
      )
    return v

  @model_validator(mode="after")
  def _content_and_calls(self) -> ChatMessage:
    if self.content is None and not (self.role == "assistant" and self.tool_calls):
      raise PydanticCustomError(
        "null_content",
        "content: a message's content is a string or a list of text parts (null only in an"
        " assistant message with tool_calls)",
        {"field": "content"},
      )
    if self.tool_calls and self.role != "assistant":
      raise PydanticCustomError(
        "tool_calls_role",
        "tool_calls: only an assistant message carries tool calls",
        {"field": "tool_calls"},
      )
    if self.role == "tool" and not self.tool_call_id:
      raise PydanticCustomError(
        "tool_call_id",
        "tool_call_id: a tool message names the call it answers",
        {"field": "tool_call_id"},
      )
    return self

  def as_template_input(self) -> dict[str, Any]:
    content = self.content
    if isinstance(content, list):
      content = "".join(p.text for p in content)
    out: dict[str, Any] = {
      "role": "system" if self.role == "developer" else self.role,
      "content": content or "",
    }
    if self.tool_calls:
      out["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
    if self.tool_call_id is not None:
      out["tool_call_id"] = self.tool_call_id
    if self.name is not None and self.role == "tool":
      out["name"] = self.name
    return out


class ChatCompletionRequest(_Request):
  """`POST /v1/chat/completions`."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(default=None, ge=1)
  logprobs: bool | None = None
  top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  tools: list[ToolDef] | None = Field(
    default=None, max_length=MAX_TOOLS, description="functions the model may call"
  )
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
    default=None, description="default 'auto' with tools, 'none' without"
  )
  parallel_tool_calls: bool | None = Field(
    default=None, description="default true: a reply may make several calls"
  )
  functions: Literal[None] | Annotated[list[Any], Field(max_length=0)] = Field(
    default=None, description="not supported yet"
  )
  function_call: Literal[None, "none"] = Field(default=None, description="not supported yet")
  audio: None = Field(default=None, description="not supported")
  modalities: (
    Literal[None] | Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)]
  ) = None

  @field_validator("functions", "function_call", "audio", "modalities", mode="before")
  @classmethod
  def _unserved_chat(cls, v: Any, info: Any) -> Any:
    return _refuse_unserved(info.field_name, v)

  @field_validator("top_logprobs")
  @classmethod
  def _top_logprobs_need_logprobs(cls, v: int | None, info: Any) -> int | None:
    if v and not info.data.get("logprobs"):
      raise PydanticCustomError("logprobs_off", "top_logprobs needs logprobs: true")
    return v

  @model_validator(mode="after")
  def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
    names = [t.function.name for t in self.tools or []]
    if len(set(names)) != len(names):
      raise PydanticCustomError(
        "duplicate_tool", "tools: two functions share a name", {"field": "tools"}
      )
    choice = self.tool_choice
    if choice == "required" and not names:
      raise PydanticCustomError(
        "tool_choice", "tool_choice: 'required' needs tools", {"field": "tool_choice"}
      )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
      raise PydanticCustomError(
        "tool_choice", "tool_choice: the function {name} is not among the tools",
        {"name": repr(choice.function.name), "field": "tool_choice"},
      )  # fmt: skip
    return self

  def tool_mode(self) -> str:
    """'none' (no tools: the reply is text), 'auto', 'required' or 'named'."""
    if not self.tools or self.tool_choice == "none":
      return "none"
    if isinstance(self.tool_choice, NamedToolChoice):
      return "named"
    return self.tool_choice or "auto"

  def limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

  def logprob_settings(self) -> tuple[bool, int]:
    return bool(self.logprobs), (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Request):
  """`POST /v1/completions`: `prompt` a string, or token ids."""

  prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]  # fmt: skip
  max_tokens: int | None = Field(default=16, ge=1)
  logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  echo: Literal[None, False] = Field(default=None, description="not supported yet")
  suffix: Literal[None, ""] = Field(default=None, description="not supported yet")
  best_of: Literal[None, 1] = Field(default=None, description="one choice per request")

  @field_validator("echo", "suffix", "best_of", mode="before")
  @classmethod
  def _unserved_completion(cls, v: Any, info: Any) -> Any:
    return _refuse_unserved(info.field_name, v)

  @field_validator("prompt", mode="before")
  @classmethod
  def _one_prompt(cls, v: Any) -> Any:
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
      if len(v) != 1 or isinstance(v[0], list):
        raise PydanticCustomError(
          "one_prompt",
          "one prompt per request: a string, a list of token ids, or a list of one string",
        )
      return v[0]
    return v

  def limit(self) -> int | None:
    return 16 if self.max_tokens is None else self.max_tokens

  def logprob_settings(self) -> tuple[bool, int]:
    return self.logprobs is not None, self.logprobs or 0


class TokenizeRequest(BaseModel):
  """`POST /tokenize` (llama-server's): the ids of `content`."""

  model_config = ConfigDict(extra="ignore", strict=True)

  content: str
  add_special: bool = False
  with_pieces: bool = False


class DetokenizeRequest(BaseModel):
  """`POST /detokenize` (llama-server's): the text of `tokens` (ids of the vocabulary)."""

  model_config = ConfigDict(extra="ignore", strict=True)

  tokens: list[int]


__all__ = [
  "ChatCompletionRequest",
  "ChatMessage",
  "CompletionRequest",
  "DetokenizeRequest",
  "LOGIT_BIAS_MAX",
  "MAX_STOP",
  "MAX_TOOLS",
  "MessageToolCall",
  "NamedToolChoice",
  "ToolDef",
  "MAX_STOP_CHARS",
  "REPEAT_PENALTY_RANGE",
  "ROLES",
  "TEMPERATURE_MAX",
  "TokenizeRequest",
  "UNSERVED",
]
