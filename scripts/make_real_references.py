"""Write llama.cpp's own outputs on the real GGUF files (scripts/fetch_real_models.py) for the
tests: tests/data/real_gguf_refs.json.

Run with the test environment's Python, giving a llama-cpp-python built natively:

    python scripts/make_real_references.py --llama-cpp-python /work/venv-llamacpp/bin/python

Per model (MODELS of fetch_real_models.py):

  ids            the token ids of scripts/real_runs.py's TEXT (our tokenizer's; the
                 tokenizer suite holds them equal to llama.cpp's)
  llama_argmax   llama.cpp's argmax at every position of ids, on the file as it is
  llama_nll      llama.cpp's mean next-token negative log-likelihood over ids
  f64_argmax, f64_nll   the same of a float64 forward of the file's dequantized weights
                 (tests/gguf_numpy_forward.py)
  f64_top        per position, the float64 forward's 8 largest logits: [ids, values]
  requant_sha256 tensor name -> sha256 of the Q8_0 blocks `llama-quantize --allow-requantize
                 ... Q8_0` writes for every tensor that is not Q8_0 in the file
  f16_sha256     the same for `llama-quantize ... Q8_0` of the file dequantized to F16
                 (scripts/real_runs.py's write_f16): every tensor llama.cpp quantized
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.fetch_real_models import MODELS, cache_dir, fetch  # noqa: E402
from scripts.real_runs import (  # noqa: E402
  TEXT,
  float64_logits,
  llama,
  llama_quantize,
  nll,
  write_f16,
)

OUT = ROOT / "tests" / "data" / "real_gguf_refs.json"


def block_hashes(path: Path, only: set[str] | None = None) -> dict[str, str]:
  """sha256 of each Q8_0 tensor's bytes in `path` (those named in `only`, if given)."""
  r = gguf.GGUFReader(path)
  return {
    t.name: hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()
    for t in r.tensors
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and (only is None or t.name in only)
  }


def references(key: str, py: str, work: Path) -> dict:
  from q8rules.checkpoint.gguf import open_gguf
  from q8rules.llm.tokenizer import GGUFTokenizer

  path = fetch(MODELS[key], cache_dir())
  with open_gguf(path) as ckpt:
    meta = ckpt.metadata
    requantized = {n for n in ckpt if ckpt.tensor_type(n) != gguf.GGMLQuantizationType.Q8_0}
  ids = GGUFTokenizer.from_metadata(meta, path=str(path)).encode(TEXT)
  q8, f16, f16_q8 = (work / f"{path.stem}.{s}.gguf" for s in ("llama-q8_0", "f16", "f16-q8_0"))
  llama_quantize(py, path, q8)
  write_f16(path, f16)
  llama_quantize(py, f16, f16_q8)
  llama(py, path, ids, work / "llama.npy")
  theirs = np.load(work / "llama.npy")
  ref = float64_logits(path, ids)
  return dict(
    file=MODELS[key].file,
    ids=ids,
    llama_argmax=theirs.argmax(-1).tolist(),
    llama_nll=nll(theirs, ids),
    f64_argmax=ref.argmax(-1).tolist(),
    f64_top=[
      [[int(i) for i in top], [float(row[i]) for i in top]]
      for row, top in zip(ref, np.argsort(-ref, -1)[:, :8], strict=True)
    ],
    f64_nll=nll(ref, ids),
    requant_sha256=block_hashes(q8, requantized),
    f16_sha256=block_hashes(f16_q8),
  )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--llama-cpp-python", required=True)
  ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "q8rules-real"))
  args = ap.parse_args()
  work = Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  refs = {key: references(key, args.llama_cpp_python, work) for key in MODELS}
  OUT.write_text(json.dumps(refs, indent=1) + "\n")
  print(f"wrote {OUT}: " + ", ".join(f"{k}: {len(v['ids'])} ids" for k, v in refs.items()))


if __name__ == "__main__":
  main()
