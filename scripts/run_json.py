"""`run`: a command in its own process whose last line of output is JSON (how the benchmarks and
the reference writers run each side: q8rules, llama.cpp in its own venv)."""

from __future__ import annotations

import json
import os
import subprocess


def run(cmd: list[str], env: dict[str, str] | None = None) -> dict:
  """The JSON object `cmd` prints last, run with `env` over this process's environment (30
  minutes at most); RuntimeError with the end of its stderr when it fails."""
  out = subprocess.run(
    cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800
  )
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


__all__ = ["run"]
