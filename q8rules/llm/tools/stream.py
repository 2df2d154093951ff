"""A reply's content and tool calls as OpenAI's streamed deltas, while it is generated."""

from __future__ import annotations

import dataclasses

from q8rules.llm.tools.reply import Reply, ToolCall
from q8rules.llm.tools.syntaxes import Syntax


@dataclasses.dataclass(frozen=True)
class Delta:
  """What one step adds: `content` and `reasoning` text, and calls completed by it (each
  given once, with its index among the reply's calls)."""

  content: str = ""
  reasoning: str = ""
  calls: tuple[tuple[int, ToolCall], ...] = ()


def read_reply(syntax: Syntax, text: str) -> Reply:
  """`text` split by `syntax`; a reply it cannot read (a call whose body is not JSON) is all
  content."""
  try:
    return syntax.parse(text)
  except ValueError:
    return Reply(text)


class ReplyStream:
  """Feeds a reply's text as it is generated and hands out what is new.

  Content and reasoning stream as they come, less a tail that could open a call (held until
  the next text shows it does not); a call is given whole once it is closed. `finish()` reads
  the whole reply (a call cut off by the end is read if its body is whole) and gives the rest.
  The deltas joined equal `syntax.parse(text)`. A reply the syntax cannot read (a call whose
  body is not JSON) is content: from the point it stops parsing, nothing more is given until
  `finish`, which gives the rest of the text.
  """

  def __init__(self, syntax: Syntax):
    self.syntax = syntax
    self.text = ""
    self._content = self._reasoning = ""
    self._calls = 0

  def feed(self, text: str) -> Delta:
    self.text += text
    try:
      return self._advance(self.syntax.parse(self.text, partial=True))
    except ValueError:  # a closed call that does not parse: `finish` gives it as content
      return Delta()

  def finish(self) -> Delta:
    return self._advance(read_reply(self.syntax, self.text))

  def _advance(self, reply: Reply) -> Delta:
    content = reply.content[len(self._content) :] if reply.content.startswith(self._content) else ""
    reasoning = (
      reply.reasoning[len(self._reasoning) :] if reply.reasoning.startswith(self._reasoning) else ""
    )
    self._content += content
    self._reasoning += reasoning
    calls = tuple(enumerate(reply.tool_calls))[self._calls :]
    self._calls = len(reply.tool_calls)
    return Delta(content, reasoning, calls)
