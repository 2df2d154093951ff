"""Write llama.cpp's outputs on a real GGUF file with a LoRA adapter that q8rules wrote, for the
tests: tests/data/real_lora_refs.json.

    python scripts/make_lora_references.py --llama-cpp-python /work/venv-llamacpp/bin/python

The adapter (`seeded_adapter`: numpy's seeded generator, the same bytes on every machine) goes
on all seven block matrices of every layer of the package index's SmolLM2-135M-Instruct Q4_1; it
is written by `save_lora_gguf` and given to llama.cpp as `lora_path`. Stored, on the text of
scripts/real_runs.py (TEXT's ids) and without and with the adapter: llama.cpp's 8 largest
logits per position ([ids, values]) and its argmax, and its 32 greedy tokens after PROMPT with
the gap between its two largest logits at each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.fetch_real_models import MODELS, cache_dir, fetch  # noqa: E402
from scripts.real_runs import GREEDY, PROMPT, TEXT, llama_greedy  # noqa: E402

OUT = ROOT / "tests" / "data" / "real_lora_refs.json"
KEY = "smollm2-q4_1"
RANK, ALPHA, SEED = 8, 16.0, 20261203


def seeded_adapter(m) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """A (K, r) ~ N(0, 1/K), B (r, N) ~ N(0, 0.1^2) float32 for every block matrix of `m` (a
  GGUFModel), drawn in the order of `m.with_lora(...).adapters()` from one seeded generator."""
  rng = np.random.default_rng(SEED)
  shapes = m.with_lora(rank=RANK, alpha=ALPHA).adapters()
  out = {}
  for name, (a, b) in shapes.items():
    k, n = a.shape[0], b.shape[1]
    out[name] = (
      (rng.standard_normal((k, RANK)) / np.sqrt(k)).astype(np.float32),
      (rng.standard_normal((RANK, n)) * 0.1).astype(np.float32),
    )
  return out


def top8(logits: np.ndarray) -> list:
  return [
    [[int(i) for i in top], [float(row[i]) for i in top]]
    for row, top in zip(logits, np.argsort(-logits, -1)[:, :8], strict=True)
  ]


def main() -> None:
  import jax.numpy as jnp

  import q8rules
  from q8rules.lora.gguf_file import save_lora_gguf

  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--llama-cpp-python", required=True)
  args = ap.parse_args()
  path = fetch(MODELS[KEY], cache_dir())
  m = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
  ids = m.tokenizer.encode(TEXT)
  prompt = m.tokenizer.encode(PROMPT)
  refs = dict(file=MODELS[KEY].file, rank=RANK, alpha=ALPHA, seed=SEED, ids=ids, prompt=prompt)
  with tempfile.TemporaryDirectory() as tmp:
    adapter = save_lora_gguf(Path(tmp) / "a.gguf", seeded_adapter(m), arch="llama", alpha=ALPHA)
    for name, lora in (("base", None), ("lora", str(adapter))):
      out = Path(tmp) / f"{name}.npy"
      q = dict(eval_ids=ids, prompt_ids=prompt, greedy=GREEDY, lora=lora, out=str(out))
      res = llama_greedy(args.llama_cpp_python, path, q)
      logits = np.load(out)
      refs[name] = dict(
        top=top8(logits),
        argmax=logits.argmax(-1).tolist(),
        greedy=res["greedy"],
        margins=res["margins"],
      )
  OUT.write_text(json.dumps(refs) + "\n")
  print(f"wrote {OUT}: {len(ids)} ids")


if __name__ == "__main__":
  main()
