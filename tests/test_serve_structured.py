"""Structured output and tool calls through `q8rules serve`, on the tiny qwen2 file with Qwen
2.5's own chat template (which renders tools and writes calls in `<tool_call>` tags).

Structured output: OpenAI's `response_format` (json_object, json_schema) and llama-server's
`json_schema` and `grammar`. Every constrained reply parses and validates against its schema
(jsonschema), streamed or not, greedy or sampled; a bad schema or grammar is a 400 naming its
field; free rows decoding beside constrained ones give the tokens they give alone.

Tool calls: `tool_choice` "required" or a named function makes the reply a call whose arguments
validate against the tool's schema (the tiny model has no wish of its own: the grammar makes
the call), `message.tool_calls` with `finish_reason: "tool_calls"`, streamed as `tool_calls`
deltas that join into the same calls; `parallel_tool_calls: false` makes one call; an assistant
message with calls and `tool` messages go back through the template; bad tool fields are 400s
naming them."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from q8rules.serve import Server
from q8rules.serve.protocol import ChatMessage
from tests._utils import matrix
from tests.test_grammar import SCHEMAS
from tests.test_serve import curl_examples, run_curl_examples, tiny_chat_model
from tests.test_tool_grammar import SCHEMA as TOOL_SCHEMA
from tests.test_tool_grammar import TOOLS

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

LIMIT = 150

SERVED = {**SCHEMAS, "array-enum-number": {
  **SCHEMAS["array-enum-number"],
  "properties": {**SCHEMAS["array-enum-number"]["properties"],
                 "score": {"type": "integer", "minimum": -5, "maximum": 5}},
}}  # fmt: skip
"""The schemas, with the unbounded number an integer in a range: a JSON number may have any
number of digits, and the tiny model's favourite token is '0' (a real model stops; this one
would fill max_tokens, still valid so far)."""


QWEN = (
  Path(__file__).parent / "data" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
).read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  model = tiny_chat_model(tmp_path_factory, "structured", template=QWEN, context=2048)
  with Server(model, parallel=3, ctx=1536, chunk=64, warm_up=False) as s:
    yield s


@pytest.fixture
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, name: str, **kw):
  form = {
    "type": "json_schema",
    "json_schema": {"name": name, "schema": SERVED[name], "strict": True},
  }
  messages = [{"role": "user", "content": f"Give me one {name} as JSON."}]
  return client.chat.completions.create(
    model="tiny-chat", messages=messages, response_format=form, max_tokens=LIMIT, **kw
  )


@pytest.mark.parametrize("name", matrix(list(SERVED), "nested"))
def test_json_schema_replies_validate(client, name):
  for kw in (
    {"temperature": 0},
    {"temperature": 1.0, "seed": 7},
    {"temperature": 0.7, "top_p": 0.9, "seed": 3},
  ):
    reply = ask(client, name, **kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", (kw, choice.message.content)
    jsonschema.validate(json.loads(choice.message.content), SERVED[name])


def test_streamed_json_object_joins_into_an_object(client):
  stream = client.chat.completions.create(
    model="tiny-chat", messages=[{"role": "user", "content": "An object, please."}],
    response_format={"type": "json_object"}, max_tokens=LIMIT, temperature=0.9, seed=11,
    stream=True, logit_bias={"34": 5},  # '"' (id 34): strings close sooner
  )  # fmt: skip
  text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
  assert isinstance(json.loads(text), dict), text


def test_llama_server_fields_on_text_completions(server):
  schema = SCHEMAS["nested"]
  with httpx.Client(timeout=120) as http:
    body = {"prompt": "JSON:", "max_tokens": LIMIT, "temperature": 0, "json_schema": schema}
    r = http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)
    body = {"prompt": "Answer:", "max_tokens": 8, "temperature": 1.0, "seed": 5,
            "grammar": 'root ::= ("yes" | "no") "!"'}  # fmt: skip
    r = http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes!", "no!")


@pytest.mark.parametrize(
  "fields, param",
  [
    (
      {
        "response_format": {
          "type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
        }
      },
      "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"grammar": "root ::= undefined"}, "grammar"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar"),
  ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(server, fields, param):
  body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
  r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param, r.json()


def test_free_and_constrained_rows_decode_together_as_alone(client):
  def free():
    out = client.chat.completions.create(
      model="tiny-chat", messages=[{"role": "user", "content": "Tell me a story."}],
      max_tokens=40, temperature=0,
    )  # fmt: skip
    return out.choices[0].message.content

  alone_free, alone_json = free(), ask(client, "object", temperature=0).choices[0].message.content
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    together = [
      pool.submit(free),
      pool.submit(ask, client, "object", temperature=0),
      pool.submit(free),
    ]
    got = [f.result() for f in together]
  assert got[0] == alone_free and got[2] == alone_free
  assert got[1].choices[0].message.content == alone_json


# --- tool calls -----------------------------------------------------------------------------

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def call_args(call) -> dict:
  args = json.loads(call.function.arguments)
  jsonschema.validate(args, TOOL_SCHEMA[call.function.name])
  return args


def test_a_required_call_is_a_tool_calls_reply_whole_and_streamed(client):
  kw = {"model": "tiny-chat", "messages": WEATHER, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": LIMIT, "temperature": 0}  # fmt: skip
  reply = client.chat.completions.create(**kw).choices[0]
  assert reply.finish_reason == "tool_calls", reply.message
  calls = reply.message.tool_calls
  assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
  whole = [(c.function.name, call_args(c)) for c in calls]
  streamed: dict[int, dict] = {}
  finish = None
  for chunk in client.chat.completions.create(**kw, stream=True):
    choice = chunk.choices[0]
    for d in choice.delta.tool_calls or []:  # OpenAI's client form: pieces joined by index
      entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
      entry["name"] += d.function.name or ""
      entry["arguments"] += d.function.arguments or ""
    finish = choice.finish_reason or finish
  assert finish == "tool_calls"
  assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == whole


def test_a_named_function_without_parallel_calls_is_one_call_to_it(client):
  for seed in (1, 2):
    reply = client.chat.completions.create(
      model="tiny-chat", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
      tool_choice={"type": "function", "function": {"name": "add"}},
      parallel_tool_calls=False, max_tokens=LIMIT, temperature=1.0, seed=seed,
    ).choices[0]  # fmt: skip
    assert reply.finish_reason == "tool_calls"
    assert [c.function.name for c in reply.message.tool_calls] == ["add"]
    call_args(reply.message.tool_calls[0])


def test_tool_results_go_back_through_the_template(server, client):
  call = {"id": "call_1", "type": "function",
          "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}  # fmt: skip
  messages = [
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
  ]
  as_sent = [ChatMessage.model_validate(m).as_template_input() for m in messages]
  rendered = server.scheduler.runner.model.apply_chat_template(as_sent, tokenize=False, tools=TOOLS)
  assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in rendered
  assert "<tool_response>\n5\n</tool_response>" in rendered
  reply = client.chat.completions.create(
    model="tiny-chat", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=8,
    temperature=0,
  )  # fmt: skip
  assert reply.usage.prompt_tokens == len(
    server.scheduler.runner.model.apply_chat_template(as_sent, tools=TOOLS)
  )


@pytest.mark.parametrize(
  "fields, param",
  [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
  ],
)  # fmt: skip
def test_a_bad_tool_field_is_a_400_naming_it(server, fields, param):
  body = {"messages": WEATHER, "max_tokens": 4, **fields}
  r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param, r.json()


def test_the_docs_tool_curl_examples_work(server):
  commands = curl_examples(tools=True)
  assert commands
  run_curl_examples(commands, server.url, "none")
