"""A LoRA adapter that q8rules writes, on a real GGUF file, against llama.cpp's run of it.

llama.cpp's outputs (tests/data/real_lora_refs.json, scripts/make_lora_references.py) are of
the package index's SmolLM2-135M-Instruct Q4_1 with a seeded adapter on all seven block
matrices of every layer, written by `save_lora_gguf` and given to llama.cpp as `lora_path`.
Here the same adapter (the same seeded bytes) goes through `load_gguf(lora=...)`: our logits
stay as close to llama.cpp's with the adapter as without it (at most 1.5x the
base file's difference), and llama.cpp's greedy text is ours wherever its choice is clear.

Skipped without the file, unless `Q8RULES_REQUIRE_MODELS=1` (CI fetches it).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.lora.gguf_file import save_lora_gguf
from scripts.make_lora_references import ALPHA, KEY, seeded_adapter
from tests.test_real_gguf import model_path

REFS = json.loads((Path(__file__).parent / "data" / "real_lora_refs.json").read_text())

pytestmark = pytest.mark.slow

CLEAR = 0.5
"""A greedy step is clear when llama.cpp's two largest logits are this far apart (our logits
differ from llama.cpp's by about 0.2 at the model's scale: rel. L2 0.01-0.03)."""


def gap(ours: np.ndarray, top: list) -> float:
  """rel. L2 between our logits and llama.cpp's over llama.cpp's 8 largest at each position."""
  got = np.stack([row[ids] for row, (ids, _) in zip(ours, top, strict=True)]).astype(np.float64)
  want = np.asarray([values for _, values in top], np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_our_adapter_file_in_llama_cpp_and_here(tmp_path):
  path = model_path(KEY)
  base = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
  adapter = save_lora_gguf(tmp_path / "a.gguf", seeded_adapter(base), arch="llama", alpha=ALPHA)
  adapted = q8rules.load_gguf(path, dtype=jnp.float32, progress=False, lora=adapter)
  ids = REFS["ids"]
  ours_base, ours_lora = base.logits(ids), adapted.logits(ids)
  base_gap, lora_gap = gap(ours_base, REFS["base"]["top"]), gap(ours_lora, REFS["lora"]["top"])
  moved = gap(ours_base, REFS["lora"]["top"])  # the base against llama.cpp with the adapter
  assert moved > 5 * lora_gap  # the adapter moved llama.cpp's logits far more than we differ
  assert lora_gap <= 1.5 * base_gap, (lora_gap, base_gap)
  agree = np.mean(ours_lora.argmax(-1) == np.asarray(REFS["lora"]["argmax"]))
  assert agree >= 0.9, agree
  for m, ref in ((base, REFS["base"]), (adapted, REFS["lora"])):
    # llama.cpp's greedy text fed back in one pass: at every step where llama.cpp's choice is
    # clear (its top two logits 0.5 or more apart), ours is the same token
    prompt, greedy, margins = REFS["prompt"], ref["greedy"], np.asarray(ref["margins"])
    logits = m.logits(prompt + greedy[:-1])[len(prompt) - 1 :]
    clear = margins >= CLEAR
    assert clear.sum() >= 0.6 * len(greedy), margins
    np.testing.assert_array_equal(logits.argmax(-1)[clear], np.asarray(greedy)[clear])
