"""Every notebook in notebooks/ runs top to bottom, offline, with no cell error.

A notebook's metadata may say what it needs beyond the test extra (`"q8rules": {"needs":
[...]}`): "real_models" (the package index's real GGUF files, fetched by
scripts/fetch_real_models.py), "tunix" (google-tunix and the `ecosystem` extra). Without them
it is skipped, unless `Q8RULES_REQUIRE_MODELS=1` (CI's later steps, which fetch them).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
  names = [p.name for p in NOTEBOOKS]
  assert "01_apply_rules.ipynb" in names


def missing(needs: list[str]) -> list[str]:
  """The needs of a notebook this environment lacks."""
  from scripts.fetch_real_models import MODELS, cache_dir

  have = {
    "real_models": all((cache_dir() / m.file).exists() for m in MODELS.values()),
    "tunix": importlib.util.find_spec("tunix") is not None,
  }
  unknown = [n for n in needs if n not in have]
  assert not unknown, f"unknown notebook needs {unknown}"
  return [n for n in needs if not have[n]]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: pathlib.Path):
  nb = nbformat.read(path, as_version=4)
  lacking = missing(nb.metadata.get("q8rules", {}).get("needs", []))
  if lacking:
    message = f"{path.name} needs {lacking}: scripts/fetch_real_models.py, the ecosystem extra"
    if os.environ.get("Q8RULES_REQUIRE_MODELS") == "1":
      pytest.fail(message)
    pytest.skip(message)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
    f"{path.name}: commit notebooks with outputs stripped"
  )
  assert "colab-badge" in nb.cells[0].source, f"{path.name}: no Colab badge in the first cell"
  client = nbclient.NotebookClient(
    nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  )
  client.execute()  # raises CellExecutionError naming the cell on any error
  errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors


@pytest.mark.slow
def test_readme_command_runs_a_notebook_headless():
  """The README's headless command, run as written from the repository root: it executes the
  notebook and exits 0 (a failing cell would make it exit 1)."""
  import re
  import shlex
  import subprocess

  root = pathlib.Path(__file__).parent.parent
  (line,) = re.findall(r"^\.venv/bin/jupyter execute .*$", (root / "README.md").read_text(), re.M)
  argv = shlex.split(line)
  argv[0] = str(pathlib.Path(sys.executable).parent / "jupyter")
  proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
