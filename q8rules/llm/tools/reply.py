"""What a model's reply holds once its tool-call syntax is read: text, reasoning, calls."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One function call, as OpenAI's `message.tool_calls[i].function` carries it.

  Attributes:
    name: the function's name.
    arguments: its arguments as JSON text (an object), `json.dumps` of what the model wrote.
    id: the call id the model wrote (Mistral's), else None (the server makes one).
  """

  name: str
  arguments: str
  id: str | None = None

  def args(self) -> Any:
    """The arguments, parsed."""
    return json.loads(self.arguments)


@dataclasses.dataclass(frozen=True)
class Reply:
  """A reply split by its syntax: `content` (what the user reads), `reasoning` (a thinking
  channel or `<think>` block, '' when none) and `tool_calls` (in the order written)."""

  content: str
  reasoning: str = ""
  tool_calls: tuple[ToolCall, ...] = ()


def arguments_text(value: Any, where: str) -> str:
  """`value` (a parsed arguments object, or JSON text of one) as canonical JSON text.

  Raises:
    ValueError: `value` is not an object (naming `where`).
  """
  if isinstance(value, str):
    value = json.loads(value)
  if not isinstance(value, dict):
    raise ValueError(f"{where}: a call's arguments are a JSON object, not {type(value).__name__}")
  return json.dumps(value, ensure_ascii=False)
