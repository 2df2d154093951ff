"""`q8rules serve`'s HTTP surface around the completions: the OpenAPI schema, the Prometheus
metrics, CORS (off unless asked for), load shedding (503 with Retry-After past --max-queue)
and uvicorn's connection limit. One server: 1 slot, 1 waiting request at most, CORS for one
origin, 6 connections, an API key.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax.numpy as jnp
import pytest

import q8rules
from q8rules.serve import Server

MODEL = Path(__file__).parent / "data" / "gguf_models" / "tiny-qwen2-q8_0.gguf"
KEY = "sk-http"
ORIGIN = "https://app.example.com"
CONNECTIONS = 6
LONG = {"prompt": [5] * 8, "max_tokens": 100, "repeat_penalty": 1.5, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
  model = q8rules.load_gguf(MODEL, dtype=jnp.float32, progress=False)
  options = dict(parallel=1, max_queue=1, ctx=128, chunk=8, api_key=KEY, cors=[ORIGIN])
  with Server(model, limit_concurrency=CONNECTIONS, **options) as s:
    yield s


def auth() -> dict[str, str]:
  return {"Authorization": f"Bearer {KEY}"}


@pytest.mark.slow
def test_the_openapi_schema_describes_the_typed_bodies(server):
  schema = httpx.get(server.url + "/openapi.json").json()  # no key needed
  chat = schema["paths"]["/v1/chat/completions"]["post"]
  body = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
  assert body.endswith("/ChatCompletionRequest")
  fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
  for name in ("messages", "temperature", "top_k", "seed", "logit_bias", "tools", "stop"):
    assert name in fields, name
  temperature = fields["temperature"]["anyOf"][0]
  assert temperature["minimum"] == 0 and temperature["maximum"] == 2
  assert set(chat["responses"]) == {"200", "400", "401", "404", "413", "415", "503"}
  assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
    "/ErrorBody"
  )
  assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_metrics_have_the_histograms_and_the_engine_gauge(server):
  r = httpx.post(server.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 6},
                 headers=auth())  # fmt: skip
  assert r.status_code == 200
  httpx.post(server.url + "/v1/completions", json={"prompt": "a", "top_p": 2}, headers=auth())
  text = httpx.get(server.url + "/metrics", headers=auth()).text
  for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
               "queue_time_seconds", "request_duration_seconds"):  # fmt: skip
    assert f"# TYPE q8rules_{name} histogram" in text, name
    count = next(line for line in text.splitlines() if line.startswith(f"q8rules_{name}_count"))
    assert float(count.split()[-1]) >= 1, count
  assert "q8rules_engine_alive 1.0" in text
  assert 'q8rules_http_errors_total{status="400"}' in text
  assert httpx.get(server.url + "/metrics").status_code == 401


def test_cors_answers_the_allowed_origin_only(server):
  preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
  ok = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
  assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
  other = httpx.options(server.url + "/v1/chat/completions",
                        headers={**preflight, "Origin": "https://evil.example"})  # fmt: skip
  assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
  r = httpx.get(server.url + "/v1/models", headers={**auth(), "Origin": ORIGIN})
  assert r.headers["access-control-allow-origin"] == ORIGIN


def test_past_the_queue_requests_are_shed_with_retry_after(server, monkeypatch):
  """1 slot and 1 waiting place: with both taken (programs slowed to 50 ms), a third request
  gets 503 with Retry-After at once, while /health stays 200; the two finish."""
  runner = server.scheduler.runner
  real = runner.decode

  def decode(n: int = 1):
    time.sleep(0.05)
    return real(n)

  monkeypatch.setattr(runner, "decode", decode)
  with ThreadPoolExecutor(2) as pool:
    first = pool.submit(httpx.post, server.url + "/v1/completions", json=LONG, headers=auth(),
                        timeout=60)  # fmt: skip
    while server.scheduler.running == 0:
      time.sleep(0.01)
    second = pool.submit(httpx.post, server.url + "/v1/completions", json=LONG, headers=auth(),
                         timeout=60)  # fmt: skip
    while server.scheduler.queued == 0:
      time.sleep(0.01)
    at = time.monotonic()
    shed = httpx.post(server.url + "/v1/chat/completions", headers=auth(),
                      json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert time.monotonic() - at < 1
    assert httpx.get(server.url + "/health").status_code == 200
    assert first.result().status_code == 200 and second.result().status_code == 200
  assert shed.status_code == 503, shed.text
  assert shed.json()["error"]["code"] == "server_overloaded"
  assert 1 <= int(shed.headers["retry-after"]) <= 60


def test_uvicorn_answers_503_past_its_connection_limit(server):
  """`limit_concurrency`: with its 6 connections open (idle), a request gets uvicorn's 503;
  once they close, requests are served again."""
  idle = [socket.create_connection((server.host, server.port)) for _ in range(CONNECTIONS)]
  try:
    time.sleep(0.2)
    assert httpx.get(server.url + "/health").status_code == 503
  finally:
    for s in idle:
      s.close()
  deadline = time.monotonic() + 5
  while httpx.get(server.url + "/health").status_code != 200:
    assert time.monotonic() < deadline
    time.sleep(0.05)
