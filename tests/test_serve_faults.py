"""Faults injected into a running `q8rules serve` engine: a fault while admitting, prefilling or
handing out one request ends that request alone (OpenAI's error body, 400 or 500) and the
others go on; a dead engine answers every waiting and running request 503 at once, /health
turns 503 and `q8rules serve` exits 1. Also the per-request timeout and a non-streamed
request's cancellation when its client leaves, on an engine slowed down on purpose.

The faults are real exceptions raised from the engine's own methods (patched for one test):
nothing else about the server is replaced.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from q8rules.engine.detokenize import TextStream
from q8rules.engine.sampling import SamplingParams
from q8rules.serve import Server, free_port
from tests.test_serve import tiny_chat_model

CTX = 128
TIMEOUT_S = 3.0
GREEDY = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return tiny_chat_model(tmp_path_factory, "faults")


@pytest.fixture(scope="module")
def server(model):
  with Server(model, parallel=2, ctx=CTX, chunk=8, timeout=TIMEOUT_S) as s:
    yield s


@pytest.fixture(scope="module")
def greedy_text(server) -> str:
  return complete(server, GREEDY).json()["choices"][0]["text"]


def complete(server, body: dict, timeout: float = 60) -> httpx.Response:
  return httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)


def ended(server, reason: str) -> int:
  return server.scheduler.metrics.requests[reason]


def assert_healthy(server, greedy_text: str) -> None:
  """/health is 200 and the same greedy request gets the same reply."""
  assert httpx.get(server.url + "/health").status_code == 200
  r = complete(server, GREEDY)
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text


def streamed_events(server, body: dict) -> list[dict | str]:
  """The data of each server-sent event of a streamed completion."""
  out: list[dict | str] = []
  with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                    timeout=60) as r:  # fmt: skip
    assert r.status_code == 200
    for line in r.iter_lines():
      if line.startswith("data: "):
        out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
  return out


def slowed(runner, seconds: float):
  """`runner.decode` that first sleeps `seconds` (the device program is the same)."""
  real = runner.decode

  def decode(n: int = 1):
    time.sleep(seconds)
    return real(n)

  return decode


def test_a_fault_while_admitting_ends_that_request_with_a_400(server, greedy_text, monkeypatch):
  """An exception turning one request's values into the engine's state (its key here) is a
  400 for that request alone, with OpenAI's body; a request decoding beside it is unmoved."""
  real = SamplingParams.key

  def key(self):
    if self.seed == 666:
      raise OverflowError("injected: this seed has no key")
    return real(self)

  monkeypatch.setattr(SamplingParams, "key", key)
  before = ended(server, "error")
  with ThreadPoolExecutor(2) as pool:
    good = pool.submit(complete, server, {**GREEDY, "max_tokens": 40})
    bad = complete(server, {**GREEDY, "seed": 666, "temperature": 0.5})
  assert bad.status_code == 400, bad.text
  error = bad.json()["error"]
  assert error["type"] == "invalid_request_error" and "OverflowError" in error["message"]
  assert good.result().status_code == 200
  assert good.result().json()["choices"][0]["text"].startswith(greedy_text)
  assert ended(server, "error") == before + 1
  assert_healthy(server, greedy_text)


def test_a_fault_while_handing_out_tokens_ends_that_request_with_a_500(
  server, greedy_text, monkeypatch
):
  """An exception while one request's tokens become text (streamed or not) is a 500 for that
  request alone: an error event then [DONE] on its stream, OpenAI's body otherwise."""
  real = TextStream.add

  def add(self, token):
    if "FAULT" in self.stop:
      raise RuntimeError("injected: this text cannot be decoded")
    return real(self, token)

  monkeypatch.setattr(TextStream, "add", add)
  faulty = {**GREEDY, "stop": ["FAULT"]}
  with ThreadPoolExecutor(3) as pool:
    good = pool.submit(complete, server, {**GREEDY, "max_tokens": 40})
    stream = pool.submit(streamed_events, server, faulty)
    whole = complete(server, faulty)
  assert whole.status_code == 500, whole.text
  assert whole.json()["error"]["type"] == "server_error"
  events = stream.result()
  assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events
  assert "RuntimeError: injected" in events[-2]["error"]["message"]
  assert good.result().json()["choices"][0]["text"].startswith(greedy_text)
  assert_healthy(server, greedy_text)


def test_a_fault_while_prefilling_ends_that_request_with_a_500(server, greedy_text, monkeypatch):
  runner = server.scheduler.runner
  real = runner.prefill

  def prefill(slot, tokens, pos, *rest):
    if pos == 0 and list(tokens[:3]) == [7, 7, 7]:
      raise RuntimeError("injected: this chunk cannot run")
    return real(slot, tokens, pos, *rest)

  monkeypatch.setattr(runner, "prefill", prefill)
  r = complete(server, {"prompt": [7, 7, 7, 9], "max_tokens": 4})
  assert r.status_code == 500 and "prefilling" in r.json()["error"]["message"], r.text
  assert server.scheduler.running == 0
  assert_healthy(server, greedy_text)


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server, monkeypatch):
  """While its tokens flow (a program every 50 ms here), a non-streamed request whose client
  disconnects is cancelled at once, not decoded on to its max_tokens."""
  monkeypatch.setattr(server.scheduler.runner, "decode", slowed(server.scheduler.runner, 0.05))
  cancelled, length = ended(server, "cancelled"), ended(server, "length")
  body = {"prompt": [5] * 8, "max_tokens": CTX - 8, "repeat_penalty": 1.5, "ignore_eos": True}
  with pytest.raises(httpx.ReadTimeout):
    complete(server, body, timeout=0.6)
  deadline = time.monotonic() + 1.0  # the whole reply would take >= 1.5 s more
  while ended(server, "cancelled") == cancelled:
    assert time.monotonic() < deadline, "the request went on decoding"
    time.sleep(0.02)
  assert ended(server, "length") == length and server.scheduler.running == 0


def test_a_request_past_the_timeout_is_cancelled_with_a_503(server, monkeypatch):
  """With timeout 3 s and a program every 200 ms, 120 tokens take 6 s: both the streamed and
  the whole request end at about 3 s with a 503 naming the timeout, their slots freed."""
  monkeypatch.setattr(server.scheduler.runner, "decode", slowed(server.scheduler.runner, 0.2))
  body = {"prompt": [5] * 8, "max_tokens": CTX - 8, "repeat_penalty": 1.5, "ignore_eos": True}
  start = time.monotonic()
  with ThreadPoolExecutor(1) as pool:
    stream = pool.submit(streamed_events, server, body)
    whole = complete(server, body)
  assert whole.status_code == 503 and "timeout" in whole.json()["error"]["message"], whole.text
  events = stream.result()
  assert events[-1] == "[DONE]" and "timeout" in events[-2]["error"]["message"]
  assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 2
  deadline = time.monotonic() + 2
  while server.scheduler.running:
    assert time.monotonic() < deadline
    time.sleep(0.02)


def test_a_dead_engine_answers_everyone_503_at_once(model):
  """A fault the engine cannot pin on one request (its decode program here) ends it: the
  running stream and both waiting requests get 503 at once, /health and the engine-alive gauge
  say so, and new requests get 503."""
  with Server(model, parallel=1, ctx=CTX, chunk=8) as server:
    runner = server.scheduler.runner
    slow = slowed(runner, 0.05)
    broken = threading.Event()

    def decode(n: int = 1):
      if broken.is_set():
        raise RuntimeError("injected: the device is gone")
      return slow(n)

    runner.decode = decode
    long = {"prompt": [5] * 8, "max_tokens": CTX - 8, "repeat_penalty": 1.5, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
      stream = pool.submit(streamed_events, server, long)
      while server.scheduler.running == 0:
        time.sleep(0.01)
      waiting = [pool.submit(complete, server, GREEDY) for _ in range(2)]
      while server.scheduler.queued < 2:
        time.sleep(0.01)
      broken.set()
      at = time.monotonic()
      answers = [w.result() for w in waiting]
      events = stream.result()
      took = time.monotonic() - at
    assert took < 2, took
    assert [a.status_code for a in answers] == [503, 503]
    assert all("engine failed" in a.json()["error"]["message"] for a in answers)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert "RuntimeError: injected" in health.json()["error"]
    assert "q8rules_engine_alive 0.0" in httpx.get(server.url + "/metrics").text
    again = complete(server, GREEDY)
    assert again.status_code == 503 and "engine failed" in again.json()["error"]["message"]


KILL = """
import sys
from q8rules.engine.scheduler import Scheduler

admit = Scheduler._admit


def fatal(self):
  if any(r.prompt_ids[:3] == [7, 7, 7] for r in self.waiting):
    raise RuntimeError("injected engine fault")
  admit(self)


Scheduler._admit = fatal
from q8rules.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_q8rules_serve_exits_1_when_its_engine_dies(model, tmp_path):
  """`q8rules serve` with a fault injected into its engine loop: the request that meets it gets
  503, and the process ends with status 1 and a `q8rules: error:` line, for a supervisor."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-c", KILL, "serve", str(model.path), "--port", str(port),
         "--parallel", "1", "--ctx", "128", "--chunk", "8", "--no-progress"]  # fmt: skip
  err = tmp_path / "stderr"
  with err.open("w") as stderr:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
  try:
    deadline = time.monotonic() + 600
    while True:
      assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        time.sleep(0.3)
    assert httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": [7, 7, 7, 9]}, timeout=60)
    assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
    assert proc.wait(60) == 1, err.read_text()[-3000:]
    errors = [line for line in err.read_text().splitlines() if line.startswith("q8rules: error:")]
    assert len(errors) == 1 and "injected engine fault" in errors[0], err.read_text()[-3000:]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
