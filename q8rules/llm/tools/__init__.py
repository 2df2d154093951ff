"""Tool calls: each model family's syntax read out of its replies, whole or streamed.

`syntax_for_template(template)` picks the family a chat template writes calls in (hermes,
llama3, mistral, gemma4, harmony: `syntaxes`); its `parse(text)` splits a reply into content,
reasoning and `ToolCall`s; `ReplyStream` gives the same split as deltas while the reply is
generated (content at once, each call once it is closed).
"""

from q8rules.llm.tools.reply import Reply, ToolCall
from q8rules.llm.tools.stream import Delta, ReplyStream, read_reply
from q8rules.llm.tools.syntaxes import FAMILIES, Syntax, syntax_for_template

__all__ = [
  "FAMILIES",
  "Delta",
  "Reply",
  "ReplyStream",
  "Syntax",
  "ToolCall",
  "read_reply",
  "syntax_for_template",
]
