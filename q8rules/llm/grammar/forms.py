"""A request's structured-output fields -> one checked llguidance grammar.

The forms (OpenAI's and llama-server's, as their servers read them):
  response_format {"type": "text"}                       no constraint
  response_format {"type": "json_object"}                any JSON object
  response_format {"type": "json_schema",
                   "json_schema": {"name", "schema", "strict"}}   JSON valid for `schema`
  json_schema (llama-server)                             JSON valid for it
  grammar (llama-server, GBNF; Lark is also read)        text the grammar derives
At most one of them may constrain a request. A schema or grammar llguidance cannot compile
(or that its vocabulary check rejects) is a `GrammarError` naming the request field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from q8rules.llm.grammar.vocab import ll_tokenizer
from q8rules.llm.tokenizer import GGUFTokenizer

ANY_OBJECT = {"type": "object"}
"""`json_object`'s schema: an object, with any properties."""

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is laid out (llguidance's compile options, a schema's own `x-guidance`
overrides them): one line, `", "` between items and `": "` after keys, as Python's `json.dumps`
writes it, so no token goes to whitespace the schema does not need."""


class GrammarError(ValueError):
  """A structured-output field that cannot constrain decoding.

  Attributes:
    field: the request field, e.g. 'response_format.json_schema.schema' or 'grammar'.
  """

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field


@dataclasses.dataclass(frozen=True)
class Grammar:
  """A compiled, checked grammar (llguidance's text form) and the field it came from.

  Attributes:
    text: what `llguidance.LLMatcher` takes.
    field: the request field that asked for it (errors name it).
    kind: 'json' or 'grammar'.
  """

  text: str
  field: str
  kind: str


def json_grammar(schema: Any, field: str, tokenizer: GGUFTokenizer) -> Grammar:
  """JSON valid for `schema` (a JSON Schema: a mapping, or its JSON text)."""
  import llguidance

  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise GrammarError(field, f"not JSON: {e}") from None
  if not isinstance(schema, Mapping):
    raise GrammarError(field, f"a JSON Schema is an object, not {type(schema).__name__}")
  try:
    text = llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_LAYOUT)
  except (ValueError, TypeError) as e:
    raise GrammarError(field, str(e)) from None
  return checked_grammar(text, field, "json", tokenizer)


def gbnf_grammar(source: str, field: str, tokenizer: GGUFTokenizer) -> Grammar:
  """The text a GBNF grammar (llama.cpp's grammar format, root rule `root`) derives."""
  import llguidance

  if not isinstance(source, str) or not source.strip():
    raise GrammarError(field, "a grammar is a non-empty GBNF text")
  try:
    text = llguidance.grammar_from("gbnf", source)
  except (ValueError, TypeError) as e:
    raise GrammarError(field, str(e)) from None
  return checked_grammar(text, field, "grammar", tokenizer)


def checked_grammar(text: str, field: str, kind: str, tokenizer: GGUFTokenizer) -> Grammar:
  """`text` (llguidance's grammar form) checked against `tokenizer`'s vocabulary (GrammarError
  naming `field` when it is refused)."""
  import llguidance

  error = llguidance.LLMatcher.validate_grammar(text, ll_tokenizer(tokenizer))
  if error:
    raise GrammarError(field, error)
  return Grammar(text=text, field=field, kind=kind)


def grammar_for_request(
  tokenizer: GGUFTokenizer,
  *,
  response_format: Mapping[str, Any] | None = None,
  json_schema: Any = None,
  grammar: str | None = None,
) -> Grammar | None:
  """The one grammar a request's fields ask for, or None (free text).

  Raises:
    GrammarError: two fields constrain at once, an unknown `response_format.type`, a
      `json_schema` form without its schema, or a schema/grammar that does not compile.
  """
  asked = []
  if response_format is not None:
    kind = response_format.get("type")
    if kind == "json_object":
      asked.append(json_grammar(ANY_OBJECT, "response_format", tokenizer))
    elif kind == "json_schema":
      spec = response_format.get("json_schema")
      if not isinstance(spec, Mapping) or "schema" not in spec:
        raise GrammarError("response_format.json_schema", "needs a 'schema' (a JSON Schema object)")
      asked.append(json_grammar(spec["schema"], "response_format.json_schema.schema", tokenizer))
    elif kind != "text":
      raise GrammarError(
        "response_format.type", f"{kind!r} is not 'text', 'json_object' or 'json_schema'"
      )
  if json_schema is not None:
    asked.append(json_grammar(json_schema, "json_schema", tokenizer))
  if grammar is not None:
    asked.append(gbnf_grammar(grammar, "grammar", tokenizer))
  if len(asked) > 1:
    fields = ", ".join(g.field for g in asked)
    raise GrammarError(asked[1].field, f"only one constraint per request ({fields} given)")
  return asked[0] if asked else None
