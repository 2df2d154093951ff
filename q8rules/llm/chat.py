"""Chat: a GGUF file's `tokenizer.chat_template` rendered as llama-cpp-python renders it, and a
conversation that streams each reply.

Rendering follows llama-cpp-python 0.3.36's `Jinja2ChatFormatter` (which follows Hugging
Face's `apply_chat_template`): a sandboxed Jinja2 environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, HF's `{% generation %}` tag passed through,
`tojson` as json.dumps (non-ASCII kept), and the variables `messages`, `bos_token`,
`eos_token` (the vocabulary's texts of BOS and EOS, '' where it has none),
`add_generation_prompt`, `raise_exception` and `strftime_now`. The text is then tokenized
with special tokens parsed and nothing added (the template writes BOS where it wants it), as
`Llama.create_chat_completion` does.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from q8rules.checkpoint._common import CheckpointError
from q8rules.engine.detokenize import TextStream

Message = Mapping[str, Any]
"""One chat message: {'role': 'system' | 'user' | 'assistant' | ..., 'content': str}."""

TEMPLATE_KEY = "tokenizer.chat_template"


class ChatTemplateError(CheckpointError):
  """A file with no chat template, or a template that does not render."""


def template_of(metadata: Mapping[str, Any], path: object) -> str:
  """The file's chat template; ChatTemplateError naming the file when it has none."""
  template = metadata.get(TEMPLATE_KEY)
  if not isinstance(template, str) or not template.strip():
    raise ChatTemplateError(
      f"{path}: no chat template ({TEMPLATE_KEY!r} is not in the file): it is not a chat model,"
      " or its converter dropped the template; prompt it with plain text instead"
    )
  return template


def _environment() -> Any:
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class IgnoreGenerationTags(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}` ... `{% endgeneration %}`: the body, as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
      parser.stream.skip(1)
      return parser.parse_statements(("name:endgeneration",), drop_needle=True)

  env = ImmutableSandboxedEnvironment(
    loader=jinja2.BaseLoader(),
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[IgnoreGenerationTags, jinja2.ext.loopcontrols],
  )
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.filters["tojson"] = (
    lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
  )
  return env


def _raise_exception(message: str) -> None:
  """A template's `raise_exception(...)` (Hugging Face's global): the render fails with it."""
  raise ValueError(message)


def _strftime_now(fmt: str) -> str:
  """A template's `strftime_now(...)` (Hugging Face's global): the local time, formatted."""
  return datetime.datetime.now().strftime(fmt)


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
  """`messages` as plain dicts; ValueError naming the first without a str role and content
  (an assistant message with `tool_calls` may have a null content)."""
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
      raise ValueError(f"message {i} has no 'role' string: {m!r}")
    calls = m["role"] == "assistant" and m.get("tool_calls")
    if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
      raise ValueError(f"message {i} ({m['role']}) has no 'content' string: {m!r}")
    out.append(dict(m))
  return out


def render(
  template: str,
  messages: Sequence[Message],
  *,
  bos_token: str = "",
  eos_token: str = "",
  add_generation_prompt: bool = True,
  path: object = "<template>",
  **extra: Any,
) -> str:
  """The chat template rendered over `messages` (see the module for the environment).

  Raises:
    ChatTemplateError naming `path`: the template does not parse, or it raises while
      rendering (its `raise_exception(...)`, or an error of Jinja2's).
    ValueError: a message without a role or content string.
  """
  import jinja2

  messages = check_messages(messages)
  try:
    compiled = _environment().from_string(template)
    return compiled.render(
      messages=messages,
      bos_token=bos_token,
      eos_token=eos_token,
      add_generation_prompt=add_generation_prompt,
      **extra,
    )
  except (jinja2.TemplateError, ValueError, TypeError) as e:
    raise ChatTemplateError(f"{path}: the chat template fails to render: {e}") from e


def apply_chat_template(
  tokenizer: Any,
  metadata: Mapping[str, Any],
  messages: Sequence[Message],
  *,
  add_generation_prompt: bool = True,
  tokenize: bool = True,
  path: object = "<gguf>",
  template: str | None = None,
  tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int] | str:
  """The file's chat template (or `template`) over `messages`: its token ids (special tokens
  parsed, nothing added), or the text when `tokenize` is False. `tools` (OpenAI's
  `{"type": "function", "function": {...}}` entries) reach the template as Hugging Face's
  `apply_chat_template(tools=...)` passes them; left out when None."""
  template = template if template is not None else template_of(metadata, path)

  def text_of(i: int | None) -> str:
    return "" if i is None else tokenizer.vocab.tokens[i]

  text = render(
    template,
    messages,
    bos_token=text_of(tokenizer.bos_id),
    eos_token=text_of(tokenizer.eos_id),
    add_generation_prompt=add_generation_prompt,
    path=path,
    **({} if tools is None else {"tools": [dict(t) for t in tools]}),
  )
  if not tokenize:
    return text
  return tokenizer.encode(text, add_special=False, parse_special=True)


class ChatSession:
  """A conversation with a `GGUFModel`: the messages so far, and each reply streamed.

  Each turn renders the template over the whole conversation and runs it from the start
  (no KV cache is kept between turns: simple, and right for any template, including those
  that rewrite earlier turns); the reply stops at the vocabulary's end-of-generation ids
  (EOS, EOT, `<|im_end|>`, `<end_of_turn>`, ... as llama.cpp marks them) or after
  `max_new_tokens`.
  """

  def __init__(
    self,
    model: Any,
    *,
    system: str | None = None,
    max_new_tokens: int = 256,
    sampler: Any = None,
  ):
    if model.tokenizer is None:
      raise ChatTemplateError(f"{model.path}: no tokenizer could be built, so no chat")
    template_of(model.metadata, model.path)  # fails now, not at the first turn
    self.model = model
    self.max_new_tokens = max_new_tokens
    self.sampler = sampler
    self.messages: list[dict[str, Any]] = []
    if system is not None:
      self.messages.append({"role": "system", "content": system})

  def prompt_ids(self) -> list[int]:
    """The ids the next reply starts from: the conversation with the generation prompt."""
    return self.model.apply_chat_template(self.messages, add_generation_prompt=True)

  def send(self, text: str) -> Iterator[str]:
    """Add the user's `text`, then yield the reply's text as it is generated (pieces that
    join to the whole reply); the reply is then in `messages`."""
    self.messages.append({"role": "user", "content": text})
    tok = self.model.tokenizer
    ids = self.prompt_ids()
    eog = set(tok.eog_ids)
    text = TextStream(tok, [])
    for t in self.model.stream(
      ids, self.max_new_tokens, stop_ids=sorted(eog), sampler=self.sampler
    ):
      if t in eog:
        break
      piece, _ = text.add(t)
      if piece:
        yield piece
    rest = text.flush()
    if rest:
      yield rest
    self.messages.append({"role": "assistant", "content": tok.decode(text.ids)})


__all__ = [
  "ChatSession",
  "ChatTemplateError",
  "apply_chat_template",
  "check_messages",
  "render",
  "template_of",
]
