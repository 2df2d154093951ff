"""Tool-call syntaxes (q8rules.llm.tools) on llama.cpp's own cases (tests/test-chat.cpp of the
llama.cpp that llama-cpp-python 0.3.36 vendors: the replies its parsers are tested on and what
they must give), and streamed in random pieces: the deltas join into the whole reply's split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from q8rules.llm.tools import FAMILIES, ReplyStream, ToolCall, syntax_for_template

SPECIAL = ("special_function", {"arg1": 1})
CASES = [
  # (family, reply, content, reasoning, [(name, arguments)])
  ("hermes", "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", "", []),
  (
    "hermes",
    '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
    "",
    "",
    [SPECIAL],
  ),
  (
    "hermes",
    'Hello, world!\nWhat\'s up?\n<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
    "Hello, world!\nWhat's up?",
    "",
    [SPECIAL],
  ),
  (
    "hermes",
    '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}\n</tool_call>',
    "",
    "",
    [SPECIAL, ("special_function_with_opt", {"arg1": 1, "arg2": 2})],
  ),
  (
    "hermes-think",
    '<think>I\'m\nthinking</think>\n\n<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
    "",
    "I'm\nthinking",
    [SPECIAL],
  ),
  ("mistral", "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", "", []),
  (
    "mistral",
    '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
    "",
    "",
    [SPECIAL],
  ),
  ("mistral", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', "", "", [SPECIAL]),
  ("gemma4", "Hello, world!", "Hello, world!", "", []),
  (
    "gemma4",
    "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?",
    "Hello, world!\nWhat's up?",
    "I'm\nthinking",
    [],
  ),
  (
    "gemma4",
    '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>',
    "",
    "",
    [("get_time", {"city": "London"})],
  ),
  (
    "gemma4",
    '<|tool_call>call:get_time{city:<|"|>San Francisco<|"|>}<tool_call|>',
    "",
    "",
    [("get_time", {"city": "San Francisco"})],
  ),
  ("gemma4", "<|tool_call>call:empty_args{}<tool_call|>", "", "", [("empty_args", {})]),
  (
    "gemma4",
    'Hello, world!\nWhat\'s up?<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>',
    "Hello, world!\nWhat's up?",
    "",
    [("get_time", {"city": "Paris"})],
  ),
  (
    "gemma4",
    '<|channel>thought\nI\'m\nthinking<channel|><|tool_call>call:get_time{city:<|"|>Paris<|"|>,days:3,'
    'opts:{metric:true,tags:[<|"|>a<|"|>,2]}}<tool_call|>',
    "",
    "I'm\nthinking",
    [("get_time", {"city": "Paris", "days": 3, "opts": {"metric": True, "tags": ["a", 2]}})],
  ),
  (
    "harmony",
    "<|channel|>final<|message|>Hello, world!\nWhat's up?",
    "Hello, world!\nWhat's up?",
    "",
    [],
  ),
  (
    "harmony",
    "<|channel|>commentary<|message|>Hello, world!\nWhat's up?",
    "Hello, world!\nWhat's up?",
    "",
    [],
  ),
  (
    "harmony",
    "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?",
    "Hello, world!\nWhat's up?",
    "I'm\nthinking",
    [],
  ),
  (
    "harmony",
    ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
    "",
    "",
    [SPECIAL],
  ),
  (
    "harmony",
    '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}',
    "",
    "",
    [SPECIAL],
  ),
  (
    "harmony",
    ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
    "",
    "",
    [SPECIAL],
  ),
  (
    "harmony",
    '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}',
    "",
    "",
    [SPECIAL],
  ),
  (
    "harmony",
    "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
    '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}<|call|>',
    "",
    "I'm\nthinking",
    [SPECIAL],
  ),
  ("llama3", "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", "", []),
  ("llama3", '{"name": "special_function", "parameters": {"arg1": 1}}', "", "", [SPECIAL]),
  (
    "llama3",
    '<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}}',
    "",
    "",
    [SPECIAL],
  ),
  ("llama3", '{"not": "a call"}', '{"not": "a call"}', "", []),
]


def check(reply, content, reasoning, calls):
  assert reply.content == content
  assert reply.reasoning == reasoning
  assert [(c.name, c.args()) for c in reply.tool_calls] == [(n, a) for n, a in calls]


@pytest.mark.parametrize("family, text, content, reasoning, calls", CASES)
def test_llama_cpp_cases(family, text, content, reasoning, calls):
  check(FAMILIES[family].parse(text), content, reasoning, calls)


@pytest.mark.parametrize("family, text, content, reasoning, calls", CASES)
def test_streamed_in_pieces_joins_into_the_whole(family, text, content, reasoning, calls):
  rng = np.random.default_rng(len(text))
  for _ in range(4):
    stream = ReplyStream(FAMILIES[family])
    got_content, got_reasoning, got_calls = "", "", []
    at = 0
    while at < len(text):
      n = int(rng.integers(1, 6))
      delta = stream.feed(text[at : at + n])
      at += n
      got_content += delta.content
      got_reasoning += delta.reasoning
      got_calls += [call for _, call in delta.calls]
    delta = stream.finish()
    got_content += delta.content
    got_reasoning += delta.reasoning
    got_calls += [call for _, call in delta.calls]
    assert got_content == content
    assert got_reasoning == reasoning
    assert [(c.name, c.args()) for c in got_calls] == [(n, a) for n, a in calls]


def test_no_call_before_it_closes():
  stream = ReplyStream(FAMILIES["hermes"])
  assert stream.feed('Sure.<tool_call>\n{"name": "f", "arguments": {"x"').calls == ()
  assert stream.feed(": 1}}\n</tool_call>").calls == ((0, ToolCall("f", json.dumps({"x": 1}))),)


def test_a_partial_marker_is_held_then_released():
  stream = ReplyStream(FAMILIES["hermes"])
  assert stream.feed("a <tool").content == "a"
  assert stream.feed("box> b").content == " <toolbox> b"


def test_bad_arguments_name_the_syntax():
  with pytest.raises(ValueError, match="hermes"):
    FAMILIES["hermes"].parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
  with pytest.raises(ValueError, match="Gemma"):
    FAMILIES["gemma4"].parse("<|tool_call>call:f{x:}<tool_call|>")


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


@pytest.mark.parametrize(
  "template, family",
  [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes"),
    ("Qwen-Qwen3-0.6B", "hermes-think"),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3"),
    ("openai-gpt-oss-120b", "harmony"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
    ("google-gemma-4-31B-it", "gemma4"),
    ("google-gemma-2-2b-it", None),
  ],
)
def test_each_template_names_its_syntax(template, family):
  syntax = syntax_for_template((TEMPLATES / f"{template}.jinja").read_text())
  assert syntax is (FAMILIES[family] if family else None)
