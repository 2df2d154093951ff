"""`python -m q8rules run MODEL.gguf`: prints the text as generated, then tokens/s."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

from q8rules.llm import cli, load_gguf

DATA = Path(__file__).parent / "data" / "gguf_models"


@pytest.mark.slow
def test_run_prints_text_and_speed(capsys):
  path = DATA / "tiny-qwen2-q8_0.gguf"
  out = cli.main(
    [
      str(path),
      "--prompt",
      "The quick brown fox",
      "--max-new-tokens",
      "8",
      "--float32",
      "--no-progress",
    ]
  )
  m = load_gguf(path, dtype=jnp.float32)
  assert out["prompt_ids"] == m.tokenizer.encode("The quick brown fox")
  assert out["new_ids"] == m.generate(out["prompt_ids"], 8, stop_ids=[m.tokenizer.eos_id])
  printed = capsys.readouterr()
  assert printed.out.startswith("The quick brown fox")
  assert printed.out.rstrip("\n") == m.tokenizer.decode(out["prompt_ids"] + out["new_ids"])
  assert "prefill: " in printed.err and "decode: " in printed.err and "tokens/s" in printed.err


def test_act_qtype_runs_the_q8_0_activation_model(capsys):
  """`--act-qtype q8_0`: the tokens are those of `load_gguf(..., act_qtype='q8_0')`."""
  path = DATA / "tiny-qwen2-q8_0.gguf"
  args = [str(path), "--ids", "1,5,9", "--max-new-tokens", "6", "--float32", "--no-progress"]
  out = cli.main([*args, "--act-qtype", "q8_0"])
  m = load_gguf(path, dtype=jnp.float32, act_qtype="q8_0")
  assert out["new_ids"] == m.generate([1, 5, 9], 6, stop_ids=[m.tokenizer.eos_id])
