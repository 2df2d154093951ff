"""Gemma 4's call arguments (`{city:<|"|>Paris<|"|>,days:3}`) as a Python value.

Its templates write a call's arguments as a dict with bare keys, strings between `<|"|>`
marks, and JSON's numbers, booleans, null, lists and dicts otherwise."""

from __future__ import annotations

import json
from typing import Any

QUOTE = '<|"|>'


class _Reader:
  def __init__(self, text: str):
    self.text, self.at = text, 0

  def fail(self, what: str) -> ValueError:
    return ValueError(f"Gemma call arguments: {what} at {self.at} in {self.text!r}")

  def skip(self) -> None:
    while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
      self.at += 1

  def eat(self, s: str) -> bool:
    self.skip()
    if self.text.startswith(s, self.at):
      self.at += len(s)
      return True
    return False

  def value(self) -> Any:
    self.skip()
    if self.eat(QUOTE):
      end = self.text.find(QUOTE, self.at)
      if end < 0:
        raise self.fail("an unclosed string")
      out, self.at = self.text[self.at : end], end + len(QUOTE)
      return out
    if self.eat("{"):
      return self.items("}", keyed=True)
    if self.eat("["):
      return self.items("]", keyed=False)
    start = self.at
    while self.at < len(self.text) and self.text[self.at] not in ",}] \t\r\n":
      self.at += 1
    word = self.text[start : self.at]
    try:
      return json.loads(word)
    except json.JSONDecodeError:
      raise self.fail(
        f"a value {word!r} that is neither a string, number, boolean nor null"
      ) from None

  def items(self, close: str, *, keyed: bool) -> Any:
    out: Any = {} if keyed else []
    if self.eat(close):
      return out
    while True:
      if keyed:
        self.skip()
        colon = self.text.find(":", self.at)
        if colon < 0:
          raise self.fail("a key without ':'")
        key = self.text[self.at : colon].strip()
        if key.startswith(QUOTE) and key.endswith(QUOTE):
          key = key[len(QUOTE) : -len(QUOTE)]
        self.at = colon + 1
        out[key] = self.value()
      else:
        out.append(self.value())
      if self.eat(close):
        return out
      if not self.eat(","):
        raise self.fail(f"neither ',' nor {close!r}")


def parse_gemma_args(text: str) -> Any:
  """`text` (`{...}` in Gemma 4's call syntax) as a dict.

  Raises:
    ValueError: malformed arguments (naming where).
  """
  reader = _Reader(text)
  if not reader.eat("{"):
    raise reader.fail("arguments that do not start with '{'")
  out = reader.items("}", keyed=True)
  reader.skip()
  if reader.at != len(text):
    raise reader.fail("text after the arguments")
  return out
