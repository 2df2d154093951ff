"""`q8rules serve` under a flood: 200 clients at once against 4 slots, three times over. Every
request is served (200) or shed cleanly (503 with OpenAI's body and Retry-After), none hangs,
/health answers 200 throughout, the server's memory stays flat, and afterwards the same greedy
request gets the same reply (the server listens on 0.0.0.0 without a key, so it warns). Also:
a port in use is found before the model loads, with one `q8rules: error:` line.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from q8rules.serve import free_port

DATA = Path(__file__).parent / "data" / "gguf_models"
MODEL = DATA / "tiny-qwen2-q8_0.gguf"
CLIENTS, SLOTS, QUEUE = 200, 4, 8
GREEDY = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0}


def rss_kib(pid: int) -> int:
  for line in Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1])
  raise AssertionError("no VmRSS")


def start(log: Path, *args: str, host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
  """`q8rules serve` on the tiny model in a subprocess (its output to `log`), once /health
  answers."""
  port = free_port()
  cmd = [sys.executable, "-m", "q8rules", "serve", str(MODEL), "--host", host, "--port",
         str(port), "--ctx", "256", "--chunk", "16", "--no-progress", *args]  # fmt: skip
  with log.open("w") as out:
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 600
  while True:
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      proc.wait()
      raise AssertionError(f"the server did not start: {log.read_text()[-3000:]}")
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      time.sleep(0.3)


async def flood(url: str, n: int) -> tuple[list[tuple[int, str, dict]], list[int]]:
  """`n` clients at once, half streamed, each with its own connection and a 120 s limit (a
  hang fails the test); /health polled meanwhile. Returns (status, Retry-After, body) per
  client and the /health statuses."""
  limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
  health: list[int] = []
  async with httpx.AsyncClient(timeout=120, limits=limits) as http:

    async def one(i: int) -> tuple[int, str, dict]:
      body = {"prompt": f"client {i} says", "max_tokens": 8 + i % 24, "temperature": 0}
      if i % 2:
        async with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
          text = "\n".join([line async for line in r.aiter_lines()])
          out = {"text": text} if r.status_code == 200 else json.loads(text)
          return r.status_code, r.headers.get("retry-after", ""), out
      r = await http.post(url + "/v1/completions", json=body)
      return r.status_code, r.headers.get("retry-after", ""), r.json()

    async def poll(done: asyncio.Event) -> None:
      while not done.is_set():
        health.append((await http.get(url + "/health")).status_code)
        await asyncio.sleep(0.05)

    done = asyncio.Event()
    poller = asyncio.create_task(poll(done))
    results = await asyncio.gather(*(one(i) for i in range(n)))
    done.set()
    await poller
  return results, health


@pytest.mark.slow
def test_200_clients_against_4_slots_are_served_or_shed_cleanly(tmp_path):
  log = tmp_path / "serve.log"
  proc, url = start(
    log, "--parallel", str(SLOTS), "--max-queue", str(QUEUE), "--timeout", "60", host="0.0.0.0"
  )  # fmt: skip
  try:
    greedy = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()
    rss, counts = [], []
    for _ in range(3):
      results, health = asyncio.run(flood(url, CLIENTS))
      statuses = [s for s, _, _ in results]
      assert set(statuses) <= {200, 503}, statuses
      for status, retry, body in results:
        if status == 503:
          assert retry.isdigit() and int(retry) >= 1, retry
          assert body["error"]["code"] == "server_overloaded", body
        elif "text" in body:
          assert body["text"].strip().endswith("data: [DONE]") and '"error"' not in body["text"], (
            body
          )
        else:
          assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
      assert health and set(health) == {200}, health
      counts.append((statuses.count(200), statuses.count(503)))
      rss.append(rss_kib(proc.pid))
    assert all(served >= SLOTS + QUEUE and shed > 0 for served, shed in counts), counts
    assert rss[2] <= rss[1] * 1.05, rss  # flat after the first flood's allocations
    again = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()
    assert again["choices"] == greedy["choices"]
    metrics = httpx.get(url + "/metrics").text
    assert 'q8rules_http_errors_total{status="503"}' in metrics
    assert "q8rules_requests_waiting 0.0" in metrics and "q8rules_requests_running 0.0" in metrics
    print(f"served / shed per flood: {counts}; server RSS after each (KiB): {rss}")
  finally:
    proc.terminate()
    proc.wait(30)
  assert "listening on 0.0.0.0 without an API key" in log.read_text(), log.read_text()[-3000:]


def test_a_port_in_use_fails_before_loading():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    start = time.monotonic()
    r = subprocess.run(
      [sys.executable, "-m", "q8rules", "serve", str(MODEL), "--port", str(port)],
      capture_output=True, text=True, timeout=120,
    )  # fmt: skip
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1, r.stderr
  assert lines[0].startswith("q8rules: error: --host 127.0.0.1 --port") and "in use" in lines[0]
  assert "compiling" not in r.stderr and time.monotonic() - start < 60
