"""tests/conftest.py's SLOW_CASES name tests that exist: a prefix that matched nothing would
leave its case in the README's test command unnoticed, or out of CI if it were renamed."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import SLOW_CASES

ROOT = Path(__file__).resolve().parent.parent


def test_every_slow_case_names_a_test_function():
  for case in SLOW_CASES:
    path, _, name = case.partition("::")
    name = name.split("[", 1)[0]
    source = ROOT / path
    assert source.is_file(), f"{case}: no file {path}"
    tree = ast.parse(source.read_text())
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert any(f.startswith(name) for f in functions if f.startswith("test")), (
      f"{case}: {path} has no test named {name}*"
    )
