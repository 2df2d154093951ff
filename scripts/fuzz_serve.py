"""Fuzz a running `q8rules serve` with schemathesis, from its own `/openapi.json`, on a real
model: thousands of generated requests (valid and invalid bodies, every operation, every
method), then the server must be alive and unchanged.

    pip install -e '.[fuzz]'                      # schemathesis
    python scripts/fetch_real_models.py           # SmolLM2-135M-Instruct (the default model)
    python scripts/fuzz_serve.py [MODEL.gguf] [--examples 500] [--seed 1]

It starts `q8rules serve` in a subprocess (2 slots of --ctx positions, an API key, loopback),
records a greedy reply, runs `schemathesis run` with the checks below (2 workers, one a slot,
so generated completions decode side by side; never more than the queue takes), then requires:
schemathesis passed (no 5xx, every status and content type as the schema documents them, each
body conforming to its schema, every request the schema does not allow refused with a 4xx),
the server process is still running, `/health` answers 200,
the same greedy request gets the same reply, and `/metrics` counts no 5xx response. It prints
how many requests schemathesis sent. Exit status 0 when all of that holds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from q8rules.serve import free_port  # noqa: E402
from scripts.fetch_real_models import MODELS, cache_dir  # noqa: E402

KEY = "sk-fuzz"
CHECKS = (
  "not_a_server_error",
  "status_code_conformance",
  "content_type_conformance",
  "response_headers_conformance",
  "response_schema_conformance",
  "negative_data_rejection",
  "unsupported_method",
)
"""schemathesis' checks run on every response. Not run: positive_data_acceptance (a request
the schema allows may still be refused: a prompt past the context, an id past the
vocabulary)."""

GREEDY = {
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 16,
  "temperature": 0,
}


def start(model: Path, port: int, ctx: int, log) -> subprocess.Popen:
  """`q8rules serve` on `model` in a subprocess, once /health answers."""
  cmd = [sys.executable, "-m", "q8rules", "serve", str(model), "--port", str(port),
         "--parallel", "2", "--ctx", str(ctx), "--api-key", KEY, "--no-progress"]  # fmt: skip
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  deadline = time.monotonic() + 600
  while True:
    if proc.poll() is not None or time.monotonic() > deadline:
      raise SystemExit(f"fuzz: the server did not start (exit {proc.poll()})")
    try:
      if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
        return proc
    except httpx.HTTPError:
      time.sleep(0.5)


def greedy(url: str) -> str:
  r = httpx.post(url + "/v1/chat/completions", json=GREEDY, timeout=120,
                 headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
  r.raise_for_status()
  return r.json()["choices"][0]["message"]["content"]


def requests_sent(report: Path) -> tuple[int, dict[str, int]]:
  """From schemathesis' NDJSON events: the requests sent, and the responses by status."""
  statuses: dict[str, int] = {}
  for line in report.read_text().splitlines():
    for status in re.findall(r'"status_code":\s*(\d{3})', line):
      statuses[status] = statuses.get(status, 0) + 1
  return sum(statuses.values()), dict(sorted(statuses.items()))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("model", nargs="?", type=Path, default=None,
                 help="a GGUF file (default: SmolLM2-135M-Instruct from fetch_real_models)")  # fmt: skip
  p.add_argument("--examples", type=int, default=500,
                 help="schemathesis' --max-examples per operation and phase")  # fmt: skip
  p.add_argument("--seed", type=int, default=1, help="schemathesis' seed")
  p.add_argument("--ctx", type=int, default=64,
                 help="positions per slot (small: a generated request decodes few tokens)")  # fmt: skip
  p.add_argument(
    "--workers", type=int, default=2, help="schemathesis' concurrent workers (the slots)"
  )
  args = p.parse_args(argv)
  model = args.model or cache_dir() / MODELS["smollm2-q4_1"].file
  if not model.exists():
    raise SystemExit(f"fuzz: {model} is missing (python scripts/fetch_real_models.py)")
  schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
  if schemathesis is None:
    raise SystemExit("fuzz: schemathesis is not installed (pip install -e '.[fuzz]')")

  port = free_port()
  url = f"http://127.0.0.1:{port}"
  with tempfile.TemporaryDirectory() as tmp:
    log_path = Path(tmp) / "server.log"
    report = Path(tmp) / "events.ndjson"
    with open(log_path, "w") as log:
      proc = start(model, port, args.ctx, log)
      try:
        before = greedy(url)
        started = time.monotonic()
        cmd = [schemathesis, "run", url + "/openapi.json", "--checks", ",".join(CHECKS),
               "--header", f"Authorization: Bearer {KEY}", "--max-examples", str(args.examples),
               "--seed", str(args.seed), "--workers", str(args.workers),
               "--request-timeout", "180", "--report", "ndjson",
               "--report-ndjson-path", str(report), "--suppress-health-check", "all"]  # fmt: skip
        run = subprocess.run(cmd, cwd=tmp)
        seconds = time.monotonic() - started
        alive = proc.poll() is None
        health = httpx.get(url + "/health", timeout=10).status_code if alive else None
        after = greedy(url) if health == 200 else None
        metrics = httpx.get(url + "/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {KEY}"}).text if alive else ""  # fmt: skip
      finally:
        if proc.poll() is None:
          proc.terminate()
          proc.wait(60)
    sent, statuses = requests_sent(report) if report.exists() else (0, {})
    server_errors = re.findall(r'q8rules_http_errors_total\{status="5\d\d"\} (\S+)', metrics)
    outcome = {
      "schemathesis_exit": run.returncode,
      "requests": sent,
      "responses_by_status": statuses,
      "seconds": round(seconds, 1),
      "server_alive": alive,
      "health": health,
      "same_greedy_reply": after == before,
      "server_5xx_counted": sum(float(x) for x in server_errors),
    }
    print("fuzz:", json.dumps(outcome))
    ok = (
      run.returncode == 0
      and alive
      and health == 200
      and after == before
      and not any(s.startswith("5") for s in statuses)
      and outcome["server_5xx_counted"] == 0
    )
    if not ok:
      print(log_path.read_text()[-20000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
