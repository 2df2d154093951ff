"""Required and named tool calls (q8rules.llm.tools.grammar): replies drawn from random logits
through the call grammar are calls in the family's syntax, the syntax's own reader reads them,
and their arguments validate against the tool's schema; a reply read while streamed gives the
same message as read whole (q8rules.serve.tool_replies)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from q8rules.llm.grammar import GrammarError
from q8rules.llm.tokenizer import GGUFTokenizer
from q8rules.llm.tools import FAMILIES
from q8rules.llm.tools.grammar import call_grammar
from q8rules.serve import tool_replies
from tests.test_grammar import draw

pytest.importorskip("llguidance")

DATA = Path(__file__).parent / "data" / "gguf_models"

TOOLS = [
  {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
      "city": {"type": "string", "maxLength": 12},
      "unit": {"enum": ["celsius", "fahrenheit"]}},
      "required": ["city", "unit"], "additionalProperties": False}}},
  {"type": "function", "function": {
    "name": "add",
    "parameters": {"type": "object", "properties": {
      "a": {"type": "integer", "minimum": -99, "maximum": 99},
      "b": {"type": "integer", "minimum": -99, "maximum": 99}},
      "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

VOCAB = {"hermes": "tiny-qwen2-q8_0.gguf", "llama3": "tiny-qwen2-q8_0.gguf",
         "harmony": "tiny-gpt-oss-q8_0.gguf"}  # fmt: skip
"""A test file whose vocabulary each family's grammar compiles against (harmony's markers are
tokens of gpt-oss's vocabulary)."""


def tokenizer(family: str) -> GGUFTokenizer:
  return GGUFTokenizer.from_gguf(DATA / VOCAB[family])


def valid_calls(family: str, text: str) -> list:
  reply = FAMILIES[family].parse(text)
  assert reply.tool_calls, text
  for call in reply.tool_calls:
    jsonschema.validate(call.args(), SCHEMA[call.name])
  return list(reply.tool_calls)


@pytest.mark.parametrize("family", ["hermes", "llama3", "harmony"])
def test_required_calls_parse_and_validate(family):
  tok = tokenizer(family)
  rng = np.random.default_rng(0)
  grammar = call_grammar(family, TOOLS, tok, parallel=family == "hermes")
  names = set()
  for _ in range(4):
    text = draw(tok, grammar, rng, limit=400, lean=4.0, special=True)
    names.update(c.name for c in valid_calls(family, text))
  assert names <= set(SCHEMA)


@pytest.mark.parametrize("family", ["hermes", "harmony"])
def test_a_named_choice_calls_that_function_once_when_not_parallel(family):
  tok = tokenizer(family)
  rng = np.random.default_rng(1)
  grammar = call_grammar(family, TOOLS, tok, only="add", parallel=False)
  for _ in range(3):
    calls = valid_calls(family, draw(tok, grammar, rng, limit=400, lean=4.0, special=True))
    assert [c.name for c in calls] == ["add"]


def test_refusals_name_tool_choice():
  tok = tokenizer("hermes")
  with pytest.raises(GrammarError, match="tool_choice: the function 'nope'"):
    call_grammar("hermes", TOOLS, tok, only="nope")
  with pytest.raises(GrammarError, match=r"tool_choice: .*gemma4.*use tool_choice 'auto'"):
    call_grammar("gemma4", TOOLS, tok)
  with pytest.raises(GrammarError, match=r"'\[TOOL_CALLS\]' is not in this model's vocabulary"):
    call_grammar("mistral", TOOLS, tok)


REPLIES = {
  "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
  ' "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b":'
  " 3}}\n</tool_call>",
  "harmony": "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
  'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "unit":'
  ' "celsius"}<|call|>',
  "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
  "broken": "Sure <tool_call>\n{not json}\n</tool_call> done",
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_streamed_deltas_join_into_the_whole_message(name):
  syntax = FAMILIES["hermes" if name == "broken" else name]
  text = REPLIES[name]
  whole, calls = tool_replies.message(syntax, text)
  reader = tool_replies.DeltaReader(syntax)
  deltas = []
  for i in range(0, len(text), 3):  # three characters a step
    deltas += reader.feed(text[i : i + 3])
  deltas += reader.finish()
  content = "".join(d.get("content", "") for d in deltas)
  reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
  streamed = [c for d in deltas for c in d.get("tool_calls", [])]
  assert [c["index"] for c in streamed] == list(range(len(streamed)))
  assert content == (whole["content"] or "")
  assert reasoning == whole.get("reasoning_content", "")
  strip = [{k: v for k, v in c.items() if k not in ("id", "index")} for c in streamed]
  assert strip == [{k: v for k, v in c.items() if k != "id"} for c in whole.get("tool_calls", [])]
  assert calls == (name != "broken")
  if name == "broken":  # a call that does not parse stays in the content, as text
    assert whole["content"] == text and "tool_calls" not in whole
  for c in whole.get("tool_calls", []):
    assert c["id"].startswith("call_") and c["type"] == "function"
    jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMA[c["function"]["name"]])
