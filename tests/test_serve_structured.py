"""Structured output through `q8rules serve`: OpenAI's `response_format` (json_object,
json_schema) and llama-server's `json_schema` and `grammar`, on the tiny qwen2 file with a
ChatML template. Every constrained reply parses and validates against its schema (jsonschema),
streamed or not, greedy or sampled; a bad schema or grammar is a 400 naming its field; free
rows decoding beside constrained ones give the tokens they give alone."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import pytest

from q8rules.serve import Server
from tests._utils import matrix
from tests.test_grammar import SCHEMAS
from tests.test_serve import tiny_chat_model

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  model = tiny_chat_model(tmp_path_factory, "structured")
  with Server(model, parallel=3, ctx=256, chunk=16) as s:
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
