"""The README's "Run a GGUF model" python snippets run as written (from the repository root)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_run_a_gguf_model_section_runs(capsys):
  text = (ROOT / "README.md").read_text()
  section = text.split("## Run a GGUF model", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    for code in blocks:
      exec(compile(code, "README.md", "exec"), {})
  finally:
    os.chdir(cwd)
  assert "The quick brown fox" in capsys.readouterr().out
