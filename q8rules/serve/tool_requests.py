"""The request fields of tool calling (OpenAI's): `tools` entries, a named `tool_choice`, and
the calls an assistant message of the conversation carries.

Pydantic models in strict mode, as the rest of `q8rules.serve.protocol`; each gives the form
a chat template reads (`as_template_input`: Hugging Face's `apply_chat_template(tools=...)`
form for tools, the arguments as an object for a call).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
"""A function's name (OpenAI's: letters, digits, '_', '-', at most 64; '.' as some templates
write namespaces)."""


class FunctionDef(BaseModel):
  """`tools[i].function`: a function the model may call, its arguments a JSON Schema."""

  model_config = ConfigDict(extra="ignore", strict=True)

  name: str = Field(pattern=FUNCTION_NAME)
  description: str | None = None
  parameters: dict[str, Any] | None = Field(
    default=None, description="a JSON Schema for the arguments (an object); none: no arguments"
  )
  strict: bool | None = None


class ToolDef(BaseModel):
  """One entry of `tools`."""

  model_config = ConfigDict(extra="ignore", strict=True)

  type: Literal["function"]
  function: FunctionDef

  def as_template_input(self) -> dict[str, Any]:
    """As Hugging Face's `apply_chat_template(tools=...)` passes it to the template."""
    f = self.function
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
      out["description"] = f.description
    out["parameters"] = f.parameters if f.parameters is not None else {"type": "object"}
    return {"type": "function", "function": out}


class FunctionName(BaseModel):
  model_config = ConfigDict(extra="ignore", strict=True)

  name: str


class NamedToolChoice(BaseModel):
  """`tool_choice: {"type": "function", "function": {"name": ...}}`: call that function."""

  model_config = ConfigDict(extra="ignore", strict=True)

  type: Literal["function"]
  function: FunctionName


class CalledFunction(BaseModel):
  model_config = ConfigDict(extra="ignore", strict=True)

  name: str
  arguments: str = Field(description="the arguments as JSON text")


class MessageToolCall(BaseModel):
  """A call in an assistant message of the conversation (`tool_calls[i]`)."""

  model_config = ConfigDict(extra="ignore", strict=True)

  id: str | None = None
  type: Literal["function"] = "function"
  function: CalledFunction

  def as_template_input(self) -> dict[str, Any]:
    """As templates read a call: the arguments parsed into an object where they are one (the
    Qwen, Llama and Mistral templates write `arguments | tojson`), else the text as sent."""
    args: Any = self.function.arguments
    try:
      parsed = json.loads(args)
    except ValueError:
      parsed = None
    if isinstance(parsed, dict):
      args = parsed
    out: dict[str, Any] = {"type": "function", "function": {"name": self.function.name,
                                                             "arguments": args}}  # fmt: skip
    if self.id is not None:
      out["id"] = self.id
    return out


__all__ = [
  "CalledFunction",
  "FUNCTION_NAME",
  "FunctionDef",
  "FunctionName",
  "MessageToolCall",
  "NamedToolChoice",
  "ToolDef",
]
