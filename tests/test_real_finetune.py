"""`q8rules finetune` with its defaults on the real SmolLM2-135M-Instruct and real text: the
Python Language Reference as CPython ships it (`pydoc_data.topics`, PSF License).

- A text of a few thousand tokens (the compound statements, 5,825 tokens): with every default
  (a tenth held out, two epochs, lr 1e-3) the held-out perplexity falls, and the last line says
  it.
- A short text (644 tokens, a new user's paragraph of notes): 40 steps make about 35 epochs;
  the eval loss rises at two evaluations in a row, the warning fires, and the adapter written
  is the best one, from before the rise, with a lower perplexity than before training.

Skipped without the file, unless `Q8RULES_REQUIRE_MODELS=1` (CI fetches it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from q8rules.cli import main
from tests.test_real_gguf import model_path

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

COMPOUND = ("for", "while", "if", "try", "with", "function", "class")
"""Topics of `pydoc_data.topics`: the compound statements."""


def finetune(tmp_path: Path, text: str, *extra: str) -> str:
  """`q8rules finetune` on the real model, stderr to a file (`2> log.txt`): the file's text."""
  notes = tmp_path / "notes.txt"
  notes.write_text(text)
  argv = ["finetune", str(model_path("smollm2-q4_1")), "--text", str(notes)]
  argv += ["--out", str(tmp_path / "adapter.gguf"), *extra]
  log = tmp_path / "log.txt"
  with open(log, "w") as f:
    saved, sys.stderr = sys.stderr, f
    try:
      assert main(argv) == 0
    finally:
      sys.stderr = saved
  text = log.read_text()
  assert "\r" not in text
  return text


def evaluations(log: str) -> list[tuple[int, float]]:
  """(step, eval perplexity) of each evaluation line."""
  out = []
  for line in log.splitlines():
    found = re.search(r"eval loss [\d.]+, perplexity ([\d.]+)", line)
    if found:
      step = 0 if line.startswith("before training") else int(re.match(r"step (\d+)", line)[1])
      out.append((step, float(found[1])))
  return out


def test_defaults_lower_the_held_out_perplexity(tmp_path):
  import pydoc_data.topics

  text = "\n\n".join(pydoc_data.topics.topics[k] for k in COMPOUND)
  log = finetune(tmp_path, text)
  assert re.search(r"5,825 tokens: 5,245 to train on; 580 held out", log), log
  assert (
    "21 steps of 4 x 128 tokens (no --steps: the fewest whole steps that make 2 epochs) make 2.0 epochs"
    in log
  ), log
  evals = evaluations(log)
  before, after = evals[0][1], min(p for _, p in evals)
  summary = log.splitlines()[-1]
  assert summary.startswith(f"eval perplexity {before:.2f} before -> {after:.2f} after"), log
  assert after < 0.7 * before, evals  # measured: 27.77 -> 12.1


def test_short_text_overfits_warns_and_keeps_the_best(tmp_path):
  import pydoc_data.topics

  log = finetune(tmp_path, pydoc_data.topics.topics["with"][:2600], "--steps", "40")
  assert re.search(r"644 tokens: 580 to train on; 64 held out", log), log
  assert re.search(r"40 steps of 4 x 128 tokens make 35\.3 epochs", log), log
  assert "warning: the eval loss rose at two evaluations in a row" in log, log
  evals = evaluations(log)
  best_step, best = min(evals, key=lambda e: e[1])
  warning = next(line for line in log.splitlines() if line.startswith("warning:"))
  rose_at = [int(s) for s in re.findall(r"at step (\d+)", warning)]
  assert 0 < best_step <= rose_at[0] and best < evals[0][1], (evals, warning)
  assert f"the adapter of step {best_step}, the lowest eval loss" in log
  assert log.splitlines()[-1].startswith(f"eval perplexity {evals[0][1]:.2f} before -> {best:.2f}")
