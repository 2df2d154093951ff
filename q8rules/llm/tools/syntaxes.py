"""Each model family's tool-call syntax: where calls start, and a reply read into a `Reply`.

The families (as llama.cpp's `common/chat` and the models' own templates write them):
  hermes    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5 / 3, Hermes)
  llama3    the whole reply one `{"name": ..., "parameters": {...}}` (Llama 3.1 / 3.2 / 3.3),
            optionally after `<|python_tag|>`
  mistral   `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`, or the newer
            `[TOOL_CALLS]name[ARGS]{...}`
  gemma4    `<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>`, thinking in
            `<|channel>thought ...<channel|>`
  harmony   gpt-oss: messages `<|channel|>C( to=functions.NAME)?<|message|>BODY<|end|>|<|call|>`
            joined by `<|start|>assistant`: analysis is reasoning, a recipient makes a call,
            final and commentary are content
A `<think>...</think>` block at the start is reasoning wherever the template writes one.

`parse(text, partial)`: with `partial`, `text` is what has been generated so far: a call not
yet closed is left out, and so is a tail that could begin a marker, so that the content of a
longer prefix always extends the content of a shorter one (what streaming relies on).
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from q8rules.llm.tools.gemma_args import parse_gemma_args
from q8rules.llm.tools.reply import Reply, ToolCall, arguments_text


class Syntax(Protocol):
  """One family's tool-call syntax."""

  name: str

  def parse(self, text: str, *, partial: bool = False) -> Reply: ...


def held_back(text: str, markers: tuple[str, ...]) -> int:
  """How many characters at the end of `text` could be the start of a marker (0: none)."""
  best = 0
  for m in markers:
    for n in range(min(len(m) - 1, len(text)), best, -1):
      if m.startswith(text[-n:]):
        best = n
        break
  return best


def _call(
  obj: Any, where: str, arg_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall:
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    raise ValueError(f"{where}: a call is an object with a 'name'")
  args = next((obj[k] for k in arg_keys if k in obj), {})
  call_id = obj.get("id")
  return ToolCall(
    obj["name"], arguments_text(args, where), str(call_id) if call_id is not None else None
  )


def split_thinking(
  text: str, partial: bool, open_: str = "<think>", close: str = "</think>"
) -> tuple[str, str]:
  """(reasoning, rest) of a reply that may start with a thinking block."""
  stripped = text.lstrip()
  if not stripped.startswith(open_):
    if partial and open_.startswith(stripped) and stripped:
      return "", ""
    return "", text
  end = stripped.find(close)
  if end < 0:
    cut = len(stripped) - (held_back(stripped, (close,)) if partial else 0)
    return stripped[len(open_) : cut].strip(), ""
  return stripped[len(open_) : end].strip(), stripped[end + len(close) :].lstrip()


class Tagged:
  """Calls between an opening and a closing tag, each a JSON object (hermes) or Gemma 4's
  `call:name{...}` (gemma4); content is the text outside them."""

  def __init__(self, name: str, open_: str, close: str, think: tuple[str, str] | None):
    self.name, self.open, self.close, self.think = name, open_, close, think

  def body(self, body: str) -> ToolCall:
    if self.name == "gemma4":
      m = re.fullmatch(r"\s*call:([\w.\-]+)(\{.*\})\s*", body, re.S)
      if not m:
        raise ValueError(f"{self.name}: a call is 'call:NAME{{...}}', not {body!r}")
      return ToolCall(m[1], arguments_text(parse_gemma_args(m[2]), self.name))
    return _call(json.loads(body), self.name)

  def parse(self, text: str, *, partial: bool = False) -> Reply:
    reasoning = ""
    if self.think:
      reasoning, text = split_thinking(text, partial, *self.think)
    content, calls, at = [], [], 0
    while True:
      start = text.find(self.open, at)
      if start < 0:
        tail = text[at:]
        if partial:
          tail = tail[: len(tail) - held_back(tail, (self.open,))].rstrip()
        content.append(tail)
        break
      content.append(text[at:start])
      end = text.find(self.close, start)
      if end < 0:
        if not partial:  # the reply ended inside a call: a whole body is still a call
          try:
            calls.append(self.body(text[start + len(self.open) :]))
          except ValueError:
            content.append(text[start:])
        break
      calls.append(self.body(text[start + len(self.open) : end]))
      at = end + len(self.close)
    text = "".join(content)
    return Reply(text.rstrip() if calls or partial else text, reasoning, tuple(calls))


class Llama3:
  """The whole reply one JSON call (`{"name", "parameters"}`), optionally after
  `<|python_tag|>`; calls may be joined by ';'. Anything else is content."""

  name = "llama3"
  TAG = "<|python_tag|>"

  def parse(self, text: str, *, partial: bool = False) -> Reply:
    body = text.strip()
    if body.startswith(self.TAG):
      body = body[len(self.TAG) :].strip()
    looks_like_call = body.startswith("{") or (partial and self.TAG.startswith(body))
    if not looks_like_call:
      return Reply(text)
    if partial:
      return Reply("")
    try:
      calls = [_call(json.loads(part), self.name) for part in _split_json_objects(body)]
    except ValueError:
      return Reply(text)
    return Reply("", "", tuple(calls))


def _split_json_objects(text: str) -> list[str]:
  """`{...}; {...}` -> the objects' texts (JSON's own decoder finds each end)."""
  decoder, out, at = json.JSONDecoder(), [], 0
  while at < len(text):
    _, end = decoder.raw_decode(text, at)
    out.append(text[at:end])
    at = end
    while at < len(text) and text[at] in " \t\r\n;":
      at += 1
  return out


class Mistral:
  """`[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` pieces."""

  name = "mistral"
  TAG = "[TOOL_CALLS]"

  def parse(self, text: str, *, partial: bool = False) -> Reply:
    start = text.find(self.TAG)
    if start < 0:
      return Reply(text[: len(text) - held_back(text, (self.TAG,))] if partial else text)
    content = text[:start].strip()
    if partial:
      return Reply(content)
    rest = text[start:]
    try:
      calls = []
      for piece in rest.split(self.TAG)[1:]:
        piece = piece.strip()
        if piece.startswith("["):
          calls += [_call(obj, self.name) for obj in json.loads(piece)]
        else:
          name, _, args = piece.partition("[ARGS]")
          calls.append(ToolCall(name.strip(), arguments_text(args, self.name)))
    except ValueError:
      return Reply(text)
    return Reply(content, "", tuple(calls))


class Harmony:
  """gpt-oss's messages: header (`<|channel|>`, a recipient `to=functions.NAME`, an optional
  `<|constrain|>`) then `<|message|>` and the body up to `<|end|>`, `<|call|>` or `<|return|>`."""

  name = "harmony"
  MARKERS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
  )
  RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")
  CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")

  def parse(self, text: str, *, partial: bool = False) -> Reply:
    if "<|message|>" not in text:  # a header still being written, or no message at all
      return Reply("" if partial else text)
    content, reasoning, calls = [], [], []
    for message in text.split("<|start|>"):
      head, sep, body = message.partition("<|message|>")
      if not sep:
        continue  # a header still being written
      ended = re.search(r"<\|(end|call|return)\|>", body)
      if ended:
        body = body[: ended.start()]
      elif partial:
        body = body[: len(body) - held_back(body, self.MARKERS)]
      recipient = self.RECIPIENT.search(head)
      channel = self.CHANNEL.search(head)
      if recipient:
        if ended or not partial:
          calls.append(ToolCall(recipient[1], arguments_text(body, self.name)))
      elif channel and channel[1] == "analysis":
        reasoning.append(body)
      else:
        content.append(body)
    return Reply("".join(content), "".join(reasoning), tuple(calls))


FAMILIES: dict[str, Syntax] = {
  "harmony": Harmony(),
  "gemma4": Tagged("gemma4", "<|tool_call>", "<tool_call|>", ("<|channel>thought", "<channel|>")),
  "hermes": Tagged("hermes", "<tool_call>", "</tool_call>", None),
  "hermes-think": Tagged("hermes", "<tool_call>", "</tool_call>", ("<think>", "</think>")),
  "mistral": Mistral(),
  "llama3": Llama3(),
}
"""Each syntax by name."""


def syntax_for_template(template: str) -> Syntax | None:
  """The tool-call syntax a chat template writes calls in, or None (it defines none)."""
  if "<|channel|>" in template and "functions." in template:
    return FAMILIES["harmony"]
  if "<|tool_call>" in template:
    return FAMILIES["gemma4"]
  if "<tool_call>" in template:
    return FAMILIES["hermes-think" if "<think>" in template else "hermes"]
  if "[TOOL_CALLS]" in template:
    return FAMILIES["mistral"]
  if '"parameters"' in template and ("<|python_tag|>" in template or "ipython" in template):
    return FAMILIES["llama3"]
  return None
