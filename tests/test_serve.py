"""`q8rules serve` on the tiny qwen2 GGUF file with a ChatML template: the `openai` client,
the docs' curl examples, bad input, cancellation, the queue, batch invariance.

One server for the module (3 slots, 128 positions each, prompt chunks of 8, an API key),
started in a thread on a free loopback port. Every request loop here is bounded in count and
in time.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import pytest
from gguf import GGUFValueType as V

import q8rules
from q8rules.engine.sampling import SamplingParams
from q8rules.engine.scheduler import DoneEvent, ErrorEvent, Request, TokenEvent
from q8rules.serve import Server
from tests._chromium import CHROMIUM, chat_once
from tests.test_llm_gguf_errors import rewrite_to

openai = pytest.importorskip("openai")

DATA = Path(__file__).parent / "data" / "gguf_models"
DOCS = Path(__file__).parent.parent / "docs" / "serve.md"
KEY = "sk-test-key"
NAME = "tiny-chat.gguf"
SLOTS, CTX = 3, 128
TEMPLATE = (
  "{% for message in messages %}"
  "{% if message['content'] == 'please fail' %}{{ raise_exception('this template refuses') }}"
  "{% endif %}"
  "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_chat_model(
  tmp_path_factory, folder: str, template: str = TEMPLATE, context: int | None = None
):
  """The tiny qwen2 Q8_0 file as `NAME` with `template` for its chat template (and `context`
  for its context length, when given), loaded in float32 (the served model of the serve
  tests)."""
  path = rewrite_to(
    tmp_path_factory.mktemp(folder), NAME, src=DATA / "tiny-qwen2-q8_0.gguf",
    typed_meta={"tokenizer.chat_template": (template, V.STRING, None)},
    meta={} if context is None else {"qwen2.context_length": context},
  )  # fmt: skip
  return q8rules.load_gguf(path, dtype=jnp.float32, progress=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return tiny_chat_model(tmp_path_factory, "serve")


@pytest.fixture(scope="module")
def server(model):
  with Server(model, parallel=SLOTS, ctx=CTX, chunk=8, api_key=KEY, max_body=1 << 16) as s:
    yield s


@pytest.fixture
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def auth() -> dict[str, str]:
  return {"Authorization": f"Bearer {KEY}"}


def test_openai_client_chat_and_completions(client):
  messages = [{"role": "user", "content": "Hello"}]
  r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
  assert r.object == "chat.completion" and r.model == NAME
  assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
  assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
  streamed = client.chat.completions.create(
    model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True,
    stream_options={"include_usage": True},
  )  # fmt: skip
  chunks = list(streamed)
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == r.choices[0].message.content
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].usage.completion_tokens == 6

  c = client.completions.create(model=NAME, prompt="Once upon", max_tokens=5, temperature=0)
  assert c.object == "text_completion" and c.usage.completion_tokens == 5
  parts = list(client.completions.create(model=NAME, prompt="Once upon", max_tokens=5,
                                         temperature=0, stream=True))  # fmt: skip
  assert "".join(p.choices[0].text for p in parts) == c.choices[0].text
  (card,) = client.models.list()
  assert card.id == NAME
  assert 0 < time.time() - card.created < 3600  # when the server took the model (it said 0)


def test_logprobs_seed_and_stop(client):
  messages = [{"role": "user", "content": "Hi"}]
  kw = dict(model=NAME, messages=messages, max_tokens=5, temperature=0.9, seed=3)
  a = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
  b = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
  assert a.choices[0].message.content == b.choices[0].message.content
  content = a.choices[0].logprobs.content
  assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
  assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob for t in content)
  text = client.completions.create(model=NAME, prompt="a b", max_tokens=12, temperature=0)
  full = text.choices[0].text
  stop = full[3:5]
  cut = client.completions.create(model=NAME, prompt="a b", max_tokens=12, temperature=0, stop=stop)
  assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_ignore_eos_goes_on_to_max_tokens(server):
  """llama-server's `ignore_eos`: the same draws, past the end-of-generation token (seed 3 at
  temperature 2 draws it after 41 tokens on this model)."""
  body = {"model": NAME, "prompt": "a b", "max_tokens": 60, "temperature": 2.0, "seed": 3}
  ended = httpx.post(server.url + "/v1/completions", json=body, headers=auth()).json()
  body["ignore_eos"] = True
  full = httpx.post(server.url + "/v1/completions", json=body, headers=auth()).json()
  assert ended["choices"][0]["finish_reason"] == "stop"
  assert ended["usage"]["completion_tokens"] < 60
  assert full["choices"][0]["finish_reason"] == "length"
  assert full["usage"]["completion_tokens"] == 60
  assert full["choices"][0]["text"].startswith(ended["choices"][0]["text"])


def test_tokenize_detokenize_health_metrics(server, model):
  r = httpx.post(server.url + "/tokenize", json={"content": "hello world"}, headers=auth())
  ids = r.json()["tokens"]
  assert ids == model.tokenizer.encode("hello world", add_special=False)
  r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=auth())
  assert r.json()["content"] == "hello world"
  assert httpx.get(server.url + "/health").json()["status"] == "ok"  # no key needed
  text = httpx.get(server.url + "/metrics", headers=auth()).text
  for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total",
               "requests_waiting", "decode_tokens_per_second"):  # fmt: skip
    assert f"# TYPE q8rules_{name} " in text


CHAT = "/v1/chat/completions"
GOOD = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
BAD = [
  ("malformed JSON", CHAT, b'{"messages": [', {}, 400),
  ("empty body", CHAT, b"", {}, 400),
  ("JSON nested too deeply", CHAT, b"[" * 30_000 + b"]" * 30_000, {}, 400),
  (
    "a body that is not UTF-8",
    "/v1/completions",
    '{"prompt": "caf\xe9"}'.encode("latin-1"),
    {},
    400,
  ),
  ("missing field", CHAT, {"max_tokens": 2}, {}, 400),
  ("wrong type", CHAT, {"messages": "hi"}, {}, 400),
  ("wrong type of a number", CHAT, {**GOOD, "max_tokens": "many"}, {}, 400),
  ("max_tokens 0", CHAT, {**GOOD, "max_tokens": 0}, {}, 400),
  ("max_tokens < 0", "/v1/completions", {"prompt": "a", "max_tokens": -3}, {}, 400),
  ("max_tokens past the context", CHAT, {**GOOD, "max_tokens": CTX}, {}, 400),
  ("prompt past the context", "/v1/completions", {"prompt": list(range(CTX))}, {}, 400),
  ("temperature < 0", CHAT, {**GOOD, "temperature": -0.5}, {}, 400),
  ("top_p 0", CHAT, {**GOOD, "top_p": 0}, {}, 400),
  ("top_p > 1", CHAT, {**GOOD, "top_p": 1.5}, {}, 400),
  ("unknown model", CHAT, {**GOOD, "model": "gpt-4"}, {}, 404),
  (
    "unknown model, not Unicode",
    CHAT,
    b'{"model": "gpt\\ud800", "messages": [{"role": "user", "content": "x"}]}',
    {},
    404,
  ),  # fmt: skip
  ("body over the limit", CHAT, {**GOOD, "pad": "x" * (1 << 17)}, {}, 413),
  ("no API key", CHAT, GOOD, {"Authorization": ""}, 401),
  ("wrong API key", CHAT, GOOD, {"Authorization": "Bearer nope"}, 401),
  ("template fails", CHAT, {"messages": [{"role": "user", "content": "please fail"}]}, {}, 400),
]
FIELDS = [  # (what, path, body, the `param` named)
  ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
  ("function role", CHAT, {"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
  (
    "tool message without its call's id",
    CHAT,
    {"messages": [{"role": "tool", "content": "x"}]},
    "messages.0.tool_call_id",
  ),  # fmt: skip
  ("null content", CHAT, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
  ("no content", CHAT, {"messages": [{"role": "user"}]}, "messages.0.content"),
  ("empty parts", CHAT, {"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
  (
    "an image part",
    CHAT,
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    "messages.0.content.0.type",
  ),  # fmt: skip
  (
    "tool calls",
    CHAT,
    {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
    "messages.0.tool_calls.0.function",
  ),  # fmt: skip
  (  # the test template defines no tool calls
    "tools",
    CHAT,
    {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]},
    "tools",
  ),  # fmt: skip
  ("tool_choice required without tools", CHAT, {**GOOD, "tool_choice": "required"}, "tool_choice"),
  (
    "response_format of no known type",
    CHAT,
    {**GOOD, "response_format": {"type": "yaml"}},
    "response_format.type",
  ),  # fmt: skip
  ("grammar not a string", CHAT, {**GOOD, "grammar": ["root"]}, "grammar"),
  ("echo", "/v1/completions", {"prompt": "a", "echo": True}, "echo"),
  ("max_tokens a string", CHAT, {**GOOD, "max_tokens": "16"}, "max_tokens"),
  ("max_tokens not whole", CHAT, {**GOOD, "max_tokens": 16.0}, "max_tokens"),
  ("max_tokens true", CHAT, {**GOOD, "max_tokens": True}, "max_tokens"),
  ("stream a string", CHAT, {**GOOD, "stream": "yes"}, "stream"),
  ("temperature a string", CHAT, {**GOOD, "temperature": "0.5"}, "temperature"),
  ("top_k past the vocabulary", CHAT, {**GOOD, "top_k": 1099511627776}, "top_k"),
  ("top_k < 0", CHAT, {**GOOD, "top_k": -1}, "top_k"),
  ("temperature > 2", CHAT, {**GOOD, "temperature": 2.5}, "temperature"),
  (
    "temperature NaN",
    CHAT,
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    "temperature",
  ),  # fmt: skip
  (
    "max_tokens infinite",
    CHAT,
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}',
    "max_tokens",
  ),  # fmt: skip
  ("repeat_penalty 0", CHAT, {**GOOD, "repeat_penalty": 0}, "repeat_penalty"),
  ("repeat_last_n past the history", CHAT, {**GOOD, "repeat_last_n": 65}, "repeat_last_n"),
  ("frequency_penalty > 2", CHAT, {**GOOD, "frequency_penalty": 3}, "frequency_penalty"),
  ("min_p > 1", CHAT, {**GOOD, "min_p": 1.5}, "min_p"),
  ("n 2", CHAT, {**GOOD, "n": 2}, "n"),
  ("top_logprobs past 20", CHAT, {**GOOD, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
  ("top_logprobs without logprobs", CHAT, {**GOOD, "top_logprobs": 2}, "top_logprobs"),
  ("logit_bias id past the vocabulary", CHAT, {**GOOD, "logit_bias": {"384": 1}}, "logit_bias"),
  ("logit_bias key not an id", CHAT, {**GOOD, "logit_bias": {"hello": 1}}, "logit_bias"),
  ("logit_bias value > 100", CHAT, {**GOOD, "logit_bias": {"5": 101}}, "logit_bias.5"),
  (
    "logit_bias too many",
    CHAT,
    {**GOOD, "logit_bias": {str(i): 1 for i in range(301)}},
    "logit_bias",
  ),  # fmt: skip
  ("five stop strings", CHAT, {**GOOD, "stop": list("abcde")}, "stop"),
  ("a long stop string", CHAT, {**GOOD, "stop": "x" * 257}, "stop"),
  ("prompt past the context", "/v1/completions", {"prompt": list(range(CTX))}, "prompt"),
  ("a token id past the vocabulary", "/v1/completions", {"prompt": [5, 384]}, "prompt"),
  ("a prompt of two strings", "/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
  ("unpaired surrogate", "/v1/completions", b'{"prompt": "a\\ud800"}', "prompt"),
  ("detokenize past the vocabulary", "/detokenize", {"tokens": [10**20]}, "tokens"),
]


GREEDY = {**GOOD, "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def greedy_reply(server) -> dict:
  """GREEDY's reply on the fresh server."""
  return httpx.post(server.url + CHAT, json=GREEDY, headers=auth()).json()["choices"]


def assert_still_serving(http: httpx.Client, url: str, want: dict) -> None:
  """The same greedy request still gets the same reply."""
  ok = http.post(url + CHAT, json=GREEDY, headers=auth())
  assert ok.status_code == 200 and ok.json()["choices"] == want, ok.text


@pytest.mark.parametrize("what, path, body, headers, status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
  server, greedy_reply, what, path, body, headers, status
):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  with httpx.Client(timeout=30) as http:
    r = http.post(
      server.url + path, content=content,
      headers={**auth(), "Content-Type": "application/json", **headers},
    )  # fmt: skip
    assert r.status_code == status, (what, r.text)
    error = r.json()["error"]
    assert error["message"] and error["type"], error
    assert_still_serving(http, server.url, greedy_reply)


@pytest.mark.parametrize("what, path, body, param", FIELDS, ids=[f[0] for f in FIELDS])
@pytest.mark.slow
def test_each_field_out_of_its_range_is_a_400_naming_it(
  server, greedy_reply, what, path, body, param
):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  with httpx.Client(timeout=30) as http:
    r = http.post(
      server.url + path, content=content, headers={**auth(), "Content-Type": "application/json"}
    )
    assert r.status_code == 400, (what, r.text)
    error = r.json()["error"]
    assert error["param"] == param, (what, error)
    assert error["message"].startswith(f"{param}: ") and error["type"] == "invalid_request_error"
    assert_still_serving(http, server.url, greedy_reply)


@pytest.mark.parametrize(
  "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_post_that_is_not_json_is_a_415(server, content_type):
  headers = auth() if content_type is None else {**auth(), "Content-Type": content_type}
  r = httpx.post(server.url + CHAT, content=json.dumps(GOOD).encode(), headers=headers)
  assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
  ok = httpx.post(
    server.url + CHAT, content=json.dumps(GOOD).encode(),
    headers={**auth(), "Content-Type": "application/json; charset=utf-8"},
  )  # fmt: skip
  assert ok.status_code == 200


def test_a_method_a_path_does_not_take_is_a_405_with_allow(server):
  for method, path in (("POST", "/health"), ("POST", "/v1/models"), ("GET", CHAT)):
    r = httpx.request(method, server.url + path, headers=auth())
    assert r.status_code == 405 and r.headers["allow"], (method, path, r.text)
    assert r.json()["error"]["message"]


def test_seeds_are_any_integer_reduced_to_32_bits(server):
  """Any JSON integer is a seed; its low 32 bits are used (llama-server's uint32): 2**64 + 3
  and -2**32 + 3 draw as 3 does, 2**63 (the issue's OverflowError) and -1 are served."""
  body = {"prompt": "a b", "max_tokens": 8, "temperature": 1.0}

  def text(seed: int) -> str:
    r = httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, headers=auth())
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]

  three = text(3)
  assert text(2**64 + 3) == three and text(-(2**32) + 3) == three
  assert text(2**63) and text(-1) is not None and text(10**40) is not None


def test_null_fields_are_their_defaults_and_neutral_unserved_values_pass(server):
  """A field sent as null is its default (as OpenAI reads it); `tools: []`, `tool_choice:
  "none"` and `response_format: {"type": "text"}` ask for nothing and are served."""
  plain = {**GOOD, "temperature": 0}
  nulls = {**plain, "top_p": None, "top_k": None, "seed": None, "stop": None, "n": None,
           "frequency_penalty": None, "presence_penalty": None, "logit_bias": None,
           "stream": None, "logprobs": None, "max_completion_tokens": None}  # fmt: skip
  neutral = {**plain, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
             "developer_field": 1}  # fmt: skip
  want = httpx.post(server.url + CHAT, json=plain, headers=auth()).json()["choices"]
  for body in (nulls, neutral):
    r = httpx.post(server.url + CHAT, json=body, headers=auth())
    assert r.status_code == 200 and r.json()["choices"] == want, r.text


def test_logit_bias_moves_the_pick(server, model, client):
  """Through the API, +100 on an id makes it the greedy pick at every step (the
  log-probabilities stay the model's); in the engine, -100 on each greedy token bans it, alone
  and in a batch beside unbiased requests (whose tokens do not move)."""
  kw = dict(model=NAME, prompt="a b", max_tokens=4, temperature=0, logprobs=1)
  forced = client.completions.create(**kw, logit_bias={"42": 100})
  piece = httpx.post(server.url + "/detokenize", json={"tokens": [42]}, headers=auth()).json()
  assert forced.choices[0].logprobs.tokens == [piece["content"]] * 4
  assert all(lp < 0 for lp in forced.choices[0].logprobs.token_logprobs)

  ids = model.tokenizer.encode("the cat sat on")
  greedy = dict(temperature=0.0)
  plain = run_together(server, model, [(ids, 6, greedy)])[0][0]
  ban = tuple((t, -100.0) for t in sorted(set(plain)))
  banned = run_together(server, model, [(ids, 6, {**greedy, "logit_bias": ban})])[0][0]
  assert not set(banned) & set(plain), (plain, banned)
  both = run_together(server, model, [(ids, 6, greedy), (ids, 6, {**greedy, "logit_bias": ban})])
  assert both[0][0] == plain and both[1][0] == banned


def test_a_text_completion_past_the_context_names_the_prompt(server):
  r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * CTX}, headers=auth())
  assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
  assert r.json()["error"]["code"] == "context_length_exceeded"
  r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 8, "max_tokens": CTX},
                 headers=auth())  # fmt: skip
  assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def slots_busy(server) -> int:
  return httpx.get(server.url + "/health").json()["slots_processing"]


def test_a_client_that_disconnects_frees_its_slot(server):
  body = {"prompt": [5] * 8, "max_tokens": CTX - 8, "stream": True, "repeat_penalty": 1.5}
  before = server.scheduler.metrics.requests["cancelled"]
  with httpx.Client(timeout=30) as http:
    with http.stream("POST", server.url + "/v1/completions", json=body, headers=auth()) as r:
      first = next(line for line in r.iter_lines() if line)
      assert json.loads(first[6:])["choices"][0]["finish_reason"] is None, first
  deadline = time.monotonic() + 20
  while server.scheduler.metrics.requests["cancelled"] == before:
    assert time.monotonic() < deadline, "the request was not cancelled"
    time.sleep(0.05)
  assert slots_busy(server) == 0


def engine_request(model, ids, n, events, done, **params):
  def emit(event):
    events.append(event)
    if not isinstance(event, TokenEvent):
      done.set()

  eog = frozenset(model.tokenizer.eog_ids)
  return Request(list(ids), n, SamplingParams(**params), [], eog, emit)


def run_together(server, model, specs):
  """Submit each (ids, n, params) once the one before has its first token (so each starts at
  another step and, all running to `n` tokens, takes the next slot); wait for all; per request
  its (tokens, logprobs, finish reason, slot)."""
  out = []
  for ids, n, params in specs:
    if out:
      deadline = time.monotonic() + 30
      while not out[-1][1]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    events, done = [], threading.Event()
    r = engine_request(model, ids, n, events, done, **params)
    r.stop_ids = frozenset()  # to n tokens: no end-of-generation id
    server.scheduler.submit(r)
    out.append((r, events, done))
  results = []
  for r, events, done in out:
    assert done.wait(60)
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    logprobs = [lp for e in events if isinstance(e, TokenEvent) for lp in (e.logprobs or [])]
    assert isinstance(events[-1], DoneEvent), events[-1]
    results.append((tokens, logprobs, events[-1].finish_reason, r.slot))
  return results


def test_batch_invariance_alone_and_beside_others(server, model):
  """Greedy and seeded-sampled requests: the same tokens and log-probabilities (bits) alone and
  in a batch of 3, at other slots and start times."""
  tok = model.tokenizer
  greedy = (tok.encode("the cat sat on"), 24, dict(temperature=0.0, logprobs=True, top_logprobs=2))
  sampled = (tok.encode("once upon a time there"), 24,
             dict(temperature=0.9, top_k=40, top_p=0.95, seed=11, logprobs=True, top_logprobs=2))  # fmt: skip
  other = ([5] * 8 + list(range(3, 40)), 60, dict(temperature=0.0, repeat_penalty=1.5))
  alone_g = run_together(server, model, [greedy])[0]
  alone_s = run_together(server, model, [sampled])[0]
  both = run_together(server, model, [other, sampled, greedy])
  assert {b[3] for b in both} == {0, 1, 2}
  assert both[2][:3] == alone_g[:3]
  assert both[1][:3] == alone_s[:3]
  assert len(alone_g[1]) == 24


def test_a_cached_prefix_gives_the_bits_of_a_miss_alone_and_in_a_batch(server, model):
  """The prefix cache: a prompt that starts as one a slot ran before prefills only the rest
  (in whole chunks), and its tokens and log-probabilities are those of the same request with
  nothing cached, alone and beside others; `/metrics` counts the reused tokens."""
  sched = server.scheduler
  assert sched.runner.keeps_prefixes and sched.runner.chunk == 8
  shared = list(range(3, 30))  # 27 tokens: three whole chunks of 8 can be reused
  greedy = (shared + [40, 41, 42], 12, dict(temperature=0.0, logprobs=True, top_logprobs=2))
  sampled = (shared + [50, 51], 12,
             dict(temperature=0.9, top_p=0.9, seed=5, logprobs=True, top_logprobs=2))  # fmt: skip
  other = ([7] * 20, 30, dict(temperature=0.0))
  sched.prefixes.clear()  # nothing cached: misses
  reused = sched.metrics.prompt_tokens_reused
  miss_g = run_together(server, model, [greedy])[0]
  sched.prefixes.clear()
  miss_s = run_together(server, model, [sampled])[0]
  assert sched.metrics.prompt_tokens_reused == reused
  hit_g = run_together(server, model, [greedy])[0]  # the slot holds `shared` from the miss
  assert sched.metrics.prompt_tokens_reused == reused + 24
  assert hit_g[:3] == miss_g[:3]
  sched.prefixes.clear()
  run_together(server, model, [(shared + [60], 2, dict(temperature=0.0))])  # cache `shared`
  before = sched.metrics.prompt_tokens_reused
  both = run_together(server, model, [other, sampled, greedy])  # `other` takes an unused slot
  assert sched.metrics.prompt_tokens_reused >= before + 24  # `sampled` hits
  assert both[1][:3] == miss_s[:3] and both[2][:3] == miss_g[:3]
  text = httpx.get(server.url + "/metrics", headers=auth()).text
  assert f"q8rules_prompt_tokens_reused_total {float(sched.metrics.prompt_tokens_reused)}" in text


def test_requests_beyond_parallel_wait_in_the_queue(server, model):
  out, events = [], []
  for _ in range(SLOTS + 2):
    ev, done = [], threading.Event()
    r = engine_request(model, [5] * 8, 20, ev, done, temperature=0.0, repeat_penalty=1.5)
    out.append((r, ev, done))
  for r, _, _ in out:
    server.scheduler.submit(r)
  queued, running = server.scheduler.queued, server.scheduler.running
  assert running <= SLOTS and queued >= 2, (queued, running)
  for _, ev, done in out:
    assert done.wait(60)
    events.append([t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids])
  assert all(e == events[0] for e in events) and events[0]
  assert server.scheduler.running == 0 and server.scheduler.queued == 0
  assert not any(isinstance(e, ErrorEvent) for _, ev, _ in out for e in ev)


def curl_examples(tools: bool = False) -> list[str]:
  """The curl commands of docs/serve.md's ```bash blocks (continuation lines joined): those
  that send `tools` when `tools` (they need a template that defines calls), else the others."""
  blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S)
  commands = []
  for block in blocks:
    for cmd in block.replace("\\\n", " ").splitlines():
      if cmd.strip().startswith("curl ") and ('"tools"' in cmd) == tools:
        commands.append(cmd.strip())
  return commands


def run_curl_examples(commands: list[str], url: str, key: str) -> None:
  """Each command against the server at `url`: it succeeds and no body or event is an error."""
  for cmd in commands:
    cmd = cmd.replace("http://127.0.0.1:8080", url).replace("$Q8RULES_API_KEY", key)
    cmd = cmd.replace("SmolLM2-135M-Instruct-Q8_0.gguf", NAME)
    r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (cmd, r.stderr)
    out = r.stdout.strip()
    if out.startswith("data: "):
      events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
      assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    else:
      assert "error" not in json.loads(out), (cmd, out)


def test_the_docs_curl_examples_work(server):
  commands = curl_examples()
  assert len(commands) >= 4
  run_curl_examples(commands, server.url, KEY)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_the_chat_page_streams_a_reply(server, tmp_path):
  """Type a message on the page at / in headless Chromium: the reply streams in (seen growing),
  then the page shows its stats."""
  shot = tmp_path / "chat.png"
  out = chat_once(server.url + "/", "Hello there", screenshot=str(shot), key=KEY)
  assert out["user"] == "Hello there"
  assert out["reply"] and not out["reply"].startswith("Error"), out
  assert "finish: " in out["stats"] and out["stats"].split()[0].isdigit(), out
  assert shot.stat().st_size > 1000


@pytest.mark.slow
def test_sigterm_ends_the_server_cleanly(model):
  """`q8rules serve` in a subprocess: SIGTERM mid-stream gives the running stream and the
  queued one a final event, the process ends (uvicorn re-raises SIGTERM once shut down) and
  the port is free again."""
  import signal
  import socket
  import sys

  from q8rules.serve import free_port

  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "q8rules", "serve", str(model.path), "--port", str(port),
         "--parallel", "1", "--ctx", "256", "--chunk", "8", "--no-progress"]  # fmt: skip
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 180
    while True:
      assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        time.sleep(0.5)
    body = {"prompt": [5] * 8, "max_tokens": 240, "stream": True, "repeat_penalty": 1.5}
    finals: list[list[str]] = [[], [], []]
    started = threading.Event()

    def read(i: int) -> None:
      with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
          if line:
            finals[i].append(line)
            started.set()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in readers:
      t.start()
    assert started.wait(60)  # one is streaming, the others wait for the one slot
    proc.send_signal(signal.SIGTERM)
    for t in readers:
      t.join(60)
    assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once done
    for lines in finals:
      assert lines[-1] == "data: [DONE]", lines[-3:]
      last = json.loads(lines[-2][6:])
      assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length"), last
    assert any("error" in json.loads(lines[-2][6:]) for lines in finals)  # one was cut short
    with socket.socket() as s:
      # The port is free for a new server. Connections the server closed first linger in
      # TIME_WAIT, so the bind is done as every server does it (uvicorn, llama-server): with
      # SO_REUSEADDR, which on Linux still fails while anything listens on the port.
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind(("127.0.0.1", port))
      s.listen()
    with pytest.raises(httpx.ConnectError):
      httpx.get(url + "/health", timeout=2)
  finally:
    if proc.poll() is None:
      proc.kill()


@pytest.mark.slow
def test_q8_0_activations_are_served_as_generate_gives_them(model):
  """A model loaded with `act_qtype='q8_0'` (`q8rules serve --act-qtype q8_0`) serves, greedy
  and beside another request, the tokens its own `generate` gives."""
  act = q8rules.load_gguf(model.path, dtype=jnp.float32, progress=False, act_qtype="q8_0")
  ids = act.tokenizer.encode("the cat sat on")
  with Server(act, parallel=2, ctx=CTX, chunk=8) as s:
    other = ([5] * 8, 20, dict(temperature=0.0))
    served = run_together(s, act, [other, (ids, 16, dict(temperature=0.0))])[1][0]
  assert act.rule.act_qtype == "q8_0"
  assert served == act.generate(ids, 16, stop_ids=())


def test_serve_takes_act_qtype():
  """`q8rules serve --act-qtype q8_0` parses (and anything else is refused by argparse)."""
  import argparse

  from q8rules.cli import serve as serve_cli

  p = argparse.ArgumentParser()
  serve_cli.add_arguments(p)
  assert p.parse_args(["m.gguf", "--act-qtype", "q8_0"]).act_qtype == "q8_0"
  assert p.parse_args(["m.gguf"]).act_qtype is None
  with pytest.raises(SystemExit):
    p.parse_args(["m.gguf", "--act-qtype", "int8"])


def test_no_cors_headers_unless_asked_for(server):
  """Without `cors`, no response carries Access-Control-Allow-Origin: browsers refuse pages of
  other origins (a preflight gets no permission)."""
  origin = {"Origin": "https://evil.example"}
  preflight = httpx.options(
    server.url + CHAT, headers={**origin, "Access-Control-Request-Method": "POST"}
  )
  assert "access-control-allow-origin" not in preflight.headers
  r = httpx.get(server.url + "/v1/models", headers={**auth(), **origin})
  assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
