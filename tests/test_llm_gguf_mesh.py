"""`load_gguf(..., mesh=)`: tensors go from the file to their shards (2 forced CPU devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_sharded_load_matches_single_device(arch):
  env = dict(
    os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
  )
  proc = subprocess.run(
    [
      sys.executable,
      str(HERE / "llm_sharded_check.py"),
      str(HERE / "data" / "gguf_models" / f"tiny-{arch}-q8_0.gguf"),
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.startswith("ok"), proc.stdout
