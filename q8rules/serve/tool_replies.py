"""A chat reply read by the model's tool-call syntax: OpenAI's `message` (content, reasoning,
`tool_calls`) whole, or its streamed deltas.

The engine's text (the one detokenizer's, special tokens written out so the markers are
there) goes through `q8rules.llm.tools.ReplyStream`: content streams as it comes, a call is
sent whole, as one `tool_calls` delta with its index, id, name and arguments, once it is
closed. A call whose body does not parse is left in the content, as text. `reasoning_content`
(llama-server's field) carries a thinking block or channel.
"""

from __future__ import annotations

import secrets
from typing import Any

from q8rules.llm.tools import Delta, ReplyStream, Syntax, ToolCall, read_reply

ONE_CALL_STOP = {"hermes": "</tool_call>", "gemma4": "<tool_call|>"}
"""The text that closes a call, per syntax: with `parallel_tool_calls: false` the reply stops
there (the call it closes is still read), so it makes one call."""


def call_id() -> str:
  return f"call_{secrets.token_hex(12)}"


def call_entry(index: int, call: ToolCall, stream: bool) -> dict[str, Any]:
  """One of OpenAI's `tool_calls` entries (with its `index` in a streamed delta)."""
  entry: dict[str, Any] = {
    "id": call.id or call_id(),
    "type": "function",
    "function": {"name": call.name, "arguments": call.arguments},
  }
  return {"index": index, **entry} if stream else entry


def message(syntax: Syntax, text: str) -> tuple[dict[str, Any], bool]:
  """The whole reply as OpenAI's assistant `message`, and whether it calls tools."""
  reply = read_reply(syntax, text)
  out: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
  if reply.reasoning:
    out["reasoning_content"] = reply.reasoning
  if reply.tool_calls:
    out["tool_calls"] = [call_entry(i, c, stream=False) for i, c in enumerate(reply.tool_calls)]
  elif out["content"] is None:
    out["content"] = ""
  return out, bool(reply.tool_calls)


class DeltaReader:
  """A streamed reply's text in, OpenAI's `delta` objects out (none for a step that adds
  nothing a client sees yet)."""

  def __init__(self, syntax: Syntax):
    self.stream = ReplyStream(syntax)
    self.calls = 0

  def feed(self, text: str) -> list[dict[str, Any]]:
    return self._deltas(self.stream.feed(text))

  def finish(self) -> list[dict[str, Any]]:
    return self._deltas(self.stream.finish())

  def _deltas(self, d: Delta) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if d.reasoning:
      out.append({"reasoning_content": d.reasoning})
    if d.content:
      out.append({"content": d.content})
    if d.calls:
      out.append({"tool_calls": [call_entry(i, c, stream=True) for i, c in d.calls]})
      self.calls += len(d.calls)
    return out


__all__ = ["DeltaReader", "ONE_CALL_STOP", "call_entry", "message"]
