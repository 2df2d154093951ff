"""q8rules.llm.compile_cache: opt-in (load_gguf changes no JAX setting); a second CLI run takes
every program from JAX's persistent compilation cache and compiles nothing (counted from
jax.monitoring events, not timed).

Each run is `python -m q8rules run` in a fresh process: the module entry point's test too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "gguf_models"
COLD = re.compile(r"(\d+) program\(s\) compiled, (\d+) from the compilation cache")


def run_cli(env: dict[str, str]) -> tuple[int, int]:
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "q8rules",
      "run",
      str(DATA / "tiny-llama-q8_0.gguf"),
      "--prompt-ids",
      "0,41,70",
      "--max-new-tokens",
      "4",
      "--no-progress",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, **env},
  )
  assert proc.returncode == 0, proc.stderr
  assert "tokens/s" in proc.stderr and "llama, 2 layers" in proc.stderr, proc.stderr
  found = COLD.search(proc.stderr)
  assert found, proc.stderr
  return int(found[1]), int(found[2])


@pytest.mark.slow
def test_second_run_compiles_nothing(tmp_path):
  env = {"Q8RULES_COMPILE_CACHE": str(tmp_path / "cache"), "Q8RULES_NO_COMPILE_CACHE": ""}
  compiled, hits = run_cli(env)
  assert compiled > 0 and hits == 0
  assert any((tmp_path / "cache").iterdir())
  compiled, hits = run_cli(env)
  assert compiled == 0 and hits > 0


@pytest.mark.slow
def test_switched_off(tmp_path):
  env = {"Q8RULES_COMPILE_CACHE": str(tmp_path / "cache"), "Q8RULES_NO_COMPILE_CACHE": "1"}
  compiled, hits = run_cli(env)
  assert compiled > 0 and hits == 0
  assert not (tmp_path / "cache").exists()


def test_default_dir(monkeypatch, tmp_path):
  from q8rules.llm import compile_cache

  monkeypatch.delenv("Q8RULES_COMPILE_CACHE", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.default_dir() == tmp_path / "q8rules" / "jax-compile"
  monkeypatch.setenv("Q8RULES_COMPILE_CACHE", str(tmp_path / "elsewhere"))
  assert compile_cache.default_dir() == tmp_path / "elsewhere"
  monkeypatch.setenv("Q8RULES_NO_COMPILE_CACHE", "1")
  assert compile_cache.disabled() and compile_cache.enable() is None


@pytest.mark.slow
def test_load_gguf_changes_no_jax_setting(tmp_path):
  """A library call changes no process-wide JAX setting: after `load_gguf` the compilation
  cache is as the process had it (off), until the program opts in."""
  code = (
    "import jax, q8rules, sys\n"
    "before = (jax.config.jax_compilation_cache_dir,"
    " jax.config.jax_persistent_cache_min_compile_time_secs)\n"
    "m = q8rules.load_gguf(sys.argv[1], progress=False)\n"
    "m.generate([1, 2], 2)\n"
    "after = (jax.config.jax_compilation_cache_dir,"
    " jax.config.jax_persistent_cache_min_compile_time_secs)\n"
    "assert after == before, (before, after)\n"
    "path = q8rules.llm.enable_compile_cache()\n"
    "assert jax.config.jax_compilation_cache_dir == str(path), path\n"
    "print(path)\n"
  )
  env = {**os.environ, "Q8RULES_COMPILE_CACHE": str(tmp_path / "cache")}
  env.pop("Q8RULES_NO_COMPILE_CACHE", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run(
    [sys.executable, "-c", code, str(DATA / "tiny-llama-q8_0.gguf")],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == str(tmp_path / "cache")
