"""llama.cpp's logits on a GGUF file, from llama-cpp-python in its own process.

The Python that has `llama_cpp`: `$Q8RULES_LLAMA_CPP_PYTHON`, else this one when it imports
`llama_cpp`, else the natively built /work/venv-llamacpp (docs/benchmarks.md); the test is
skipped when none has it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
ids = json.loads(sys.argv[2])
llm = Llama(sys.argv[1], n_ctx=max(64, len(ids)), logits_all=True, verbose=False, n_threads=2)
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[: len(ids)], np.float32))
"""


def llama_cpp_python() -> str | None:
  """The Python that runs llama-cpp-python, or None."""
  env = os.environ.get("Q8RULES_LLAMA_CPP_PYTHON")
  if env:
    return env
  if importlib.util.find_spec("llama_cpp") is not None:
    return sys.executable
  native = Path("/work/venv-llamacpp")  # the native build docs/benchmarks.md describes
  installed = any(native.glob("lib/python*/site-packages/llama_cpp/__init__.py"))
  return str(native / "bin" / "python") if installed else None


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
  """llama.cpp's logits (len(ids), vocab) float32 at every position of `ids` on `path`;
  the test fails with llama.cpp's own message when it cannot load the file."""
  py = llama_cpp_python()
  if py is None:
    pytest.skip("llama-cpp-python not found (set Q8RULES_LLAMA_CPP_PYTHON)")
  with tempfile.TemporaryDirectory() as d:
    out = Path(d) / "logits.npy"
    cmd = [py, "-c", textwrap.dedent(SCRIPT), str(path), json.dumps(list(map(int, ids))), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"llama.cpp could not run {path}:\n{res.stderr[-3000:]}"
    return np.load(out)
