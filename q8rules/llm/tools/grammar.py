"""The grammar a reply follows when it must call a tool (`tool_choice` "required" or a named
function): the family's call syntax around JSON arguments valid for each tool's schema.

One llguidance Lark grammar a request, its arguments an inline `%json` schema (an `anyOf` of
the tools, each its name as a constant and its `parameters` schema), laid out as the other
constrained JSON (`q8rules.llm.grammar.forms.JSON_LAYOUT`). The families:

  hermes    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one a line when
            parallel calls are allowed
  llama3    `{"name": ..., "parameters": {...}}`: the whole reply, one call
  mistral   `[TOOL_CALLS]` (a control token) then a JSON list of `{"name", "arguments"}`
            (one item unless parallel)
  harmony   `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
Gemma 4's calls write their arguments in its own notation, not JSON: a required call there
is refused (`GrammarError` on `tool_choice`); its `auto` calls are still read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from q8rules.llm.grammar.forms import JSON_LAYOUT, Grammar, GrammarError, checked_grammar
from q8rules.llm.tokenizer import GGUFTokenizer

FIELD = "tool_choice"


def _schema(tools: Sequence[Mapping[str, Any]], args_key: str) -> dict[str, Any]:
  """A call to one of `tools` as a JSON Schema: {name: const, args_key: its parameters}."""
  options = []
  for tool in tools:
    f = tool["function"]
    params = f.get("parameters") or {"type": "object"}
    options.append({
      "type": "object",
      "properties": {"name": {"const": f["name"]}, args_key: params},
      "required": ["name", args_key],
      "additionalProperties": False,
    })  # fmt: skip
  return options[0] if len(options) == 1 else {"anyOf": options}


def _json(schema: Mapping[str, Any]) -> str:
  return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _token(tokenizer: GGUFTokenizer, text: str, family: str) -> str:
  """The vocabulary's token whose text is `text`, as a Lark rule item (`<[id]>`)."""
  try:
    return f"<[{tokenizer.vocab.tokens.index(text)}]>"
  except ValueError:
    raise GrammarError(
      FIELD, f"the {family} syntax's token {text!r} is not in this model's vocabulary"
    ) from None


def _lark(
  family: str, tools: Sequence[Mapping[str, Any]], parallel: bool, tokenizer: GGUFTokenizer
) -> str:
  def tok(text: str) -> str:
    return _token(tokenizer, text, family)

  if family == "hermes":
    call = f'"<tool_call>\\n" {_json(_schema(tools, "arguments"))} "\\n</tool_call>"'
    start = 'call ("\\n" call)*' if parallel else "call"
    return f"start: {start}\ncall: {call}\n"
  if family == "llama3":
    return f"start: {_json(_schema(tools, 'parameters'))}\n"
  if family == "mistral":
    items = {"type": "array", "items": _schema(tools, "arguments"), "minItems": 1}
    if not parallel:
      items["maxItems"] = 1
    return f"start: {tok('[TOOL_CALLS]')} {_json(items)}\n"
  if family == "harmony":
    calls = []
    for tool in tools:
      f = tool["function"]
      params = f.get("parameters") or {"type": "object"}
      header = json.dumps(f"commentary to=functions.{f['name']} ")
      calls.append(
        f'{tok("<|channel|>")} {header} {tok("<|constrain|>")} "json" {tok("<|message|>")}'
        f" {_json(params)} {tok('<|call|>')}"
      )
    return "start: " + " | ".join(calls) + "\n"
  raise GrammarError(
    FIELD,
    f"a required tool call is not available for the {family} tool-call syntax (its arguments"
    " are not JSON); use tool_choice 'auto'",
  )


def call_grammar(
  family: str,
  tools: Sequence[Mapping[str, Any]],
  tokenizer: GGUFTokenizer,
  *,
  only: str | None = None,
  parallel: bool = True,
) -> Grammar:
  """The grammar of a reply that calls `tools` (their template form: {"type": "function",
  "function": {"name", "parameters"}}) in `family`'s syntax; only the function `only` when
  given; several calls when `parallel` and the syntax writes several.

  Raises:
    GrammarError on `tool_choice`: no such tool, a syntax with no JSON arguments, or a schema
      llguidance cannot compile.
  """
  import llguidance

  if only is not None:
    tools = [t for t in tools if t["function"]["name"] == only]
    if not tools:
      raise GrammarError(FIELD, f"the function {only!r} is not among the tools")
  source = _lark(family, tools, parallel, tokenizer)
  try:
    text = llguidance.grammar_from("lark", source)
  except (ValueError, TypeError) as e:
    raise GrammarError(FIELD, f"the tools' schemas do not compile: {e}") from None
  return checked_grammar(text, FIELD, "tools", tokenizer)


__all__ = ["call_grammar"]
