"""Every notebook in notebooks/ runs top to bottom, offline, with no cell error."""

from __future__ import annotations

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
  names = [p.name for p in NOTEBOOKS]
  assert "01_apply_rules.ipynb" in names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: pathlib.Path):
  nb = nbformat.read(path, as_version=4)
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
