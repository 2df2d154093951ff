"""The text of generated tokens as they come (`q8rules run`'s, `chat`'s and `serve`'s): decoded
incrementally, cut at stop strings.

`TextStream.add(token)` returns the new text that is safe to send: a character whose bytes are
not all there yet is held back (the decoder gives U+FFFD for it), and so is a tail that could
still become a stop string. The text is decoded from the last sent ids on, as vLLM and TGI do (the
text of ids[prefix:] minus that of ids[prefix:read], `read` where the sent text ends and
`prefix` where the text before it began), so each token costs a few pieces, not the whole
output, and a tokenizer that drops a leading space at the start of a text drops it from both.
"""

from __future__ import annotations

from typing import Any


class TextStream:
  """The text of one request's tokens (the pieces `add` and `flush` return join to the
  tokenizer's text of them all, up to a stop string).

  Args:
    tokenizer: a `GGUFTokenizer` (None: each token's text is ' <id>').
    stop: stop strings: the text ends before the first one, which is not part of it.
    special: write control tokens' text too (a tool-call syntax's markers: `<|channel|>`,
      `[TOOL_CALLS]`); by default they are left out, as llama.cpp's detokenizer does.
  """

  def __init__(self, tokenizer: Any, stop: list[str], special: bool = False):
    self.tokenizer = tokenizer
    self.special = special
    self.stop = [s for s in stop if s]
    self.ids: list[int] = []
    self.text = ""  # all the text decoded so far (up to a stop string once found)
    self.sent = 0  # how much of `text` went out
    self._prefix = 0  # ids[_prefix:_read] are decoded into `text` already, as context
    self._read = 0
    self.stopped = False

  def _decode(self, ids: list[int]) -> str:
    if self.tokenizer is None:
      return "".join(f" {i}" for i in ids)
    return self.tokenizer.decode(ids, special=self.special)

  def add(self, token: int) -> tuple[str, bool]:
    """Take `token`; returns (the text that may go out now, whether a stop string ended it)."""
    if self.stopped:
      return "", True
    self.ids.append(token)
    before = self._decode(self.ids[self._prefix : self._read])
    now = self._decode(self.ids[self._prefix :])
    if now.endswith("\ufffd") or len(now) <= len(before):
      return "", False  # a character still incomplete (or nothing new)
    start = len(self.text)
    self.text += now[len(before) :]
    self._prefix, self._read = self._read, len(self.ids)
    if self._check_stop(start):
      return self._take(len(self.text)), True
    hold = max((len(s) - 1 for s in self.stop), default=0)
    return self._take(self._safe_end(hold)), False

  def _check_stop(self, start: int) -> bool:
    """Cut `text` at the first stop string that ends after `start`."""
    longest = max((len(s) for s in self.stop), default=0)
    lo = max(start - longest + 1, 0)
    found = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
    if not found:
      return False
    self.text = self.text[: min(found)]
    self.stopped = True
    return True

  def _safe_end(self, hold: int) -> int:
    """Where the sendable text ends: before the longest tail that is a stop string's start."""
    end = len(self.text)
    for k in range(min(hold, end), 0, -1):
      tail = self.text[end - k :]
      if any(s.startswith(tail) for s in self.stop):
        return end - k
    return end

  def _take(self, end: int) -> str:
    out = self.text[self.sent : end]
    self.sent = max(self.sent, end)
    return out

  def flush(self) -> str:
    """What is left to send at the end (held-back text, a last incomplete character)."""
    if not self.stopped and self.ids:
      full = self._decode(self.ids[self._prefix :])
      before = self._decode(self.ids[self._prefix : self._read])
      if len(full) > len(before):
        self.text += full[len(before) :]
        self._read = len(self.ids)
    return self._take(len(self.text))


__all__ = ["TextStream"]
