"""llama.cpp's logits and greedy tokens on the small gpt-oss files of tests/gpt_oss_gguf_writer.py
(written with gguf-py alone, as llama.cpp's converter lays gpt-oss out; independent of the
other scripts): tests/data/gguf_models/independent-gpt-oss.npz, which
tests/test_gpt_oss_independent.py compares q8rules with.

Run with a Python that has gguf and numpy (the test environment will do), naming one that has
llama-cpp-python when it is another:

    python scripts/make_gpt_oss_reference.py [--llama-python /path/to/python] [--out DIR]

For each case of CASES the file is written in a temporary directory, llama.cpp evaluates the
prompt and continues it greedily (`llama_logits`, in a child process of `--llama-python`),
and the npz keeps, per case `c`: `c_spec` (the `Spec` as JSON), `c_weights_sha256` (of the
weights the writer made: the test writes the file again and checks it is the same),
`c_n_prompt`, `c_tokens` (prompt + greedy continuation) and `c_logits` (float32, one row per
fed token). llama.cpp runs with an F32 KV cache and flash attention off, as every reference
of this project; with its defaults (an F16 KV cache) its logits are about 2e-3 from its own
F32-cache ones on these files, which the script prints as `f16-cache gap`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NAME = "independent-gpt-oss.npz"
N_PROMPT = 20
N_NEW = 12
N_CTX = 128
CASES = {
  # n_head * head_dim = 96 > n_embd = 64
  "wide": {},
  # n_head * head_dim = n_embd = 64
  "equal": {"head_dim": 16, "seed": 1},
  # n_head * head_dim = 48 < n_embd = 72, 3 KV heads, 3 layers
  "narrow": {"dim": 72, "heads": 6, "kv_heads": 3, "head_dim": 8, "layers": 3, "seed": 2},
}
"""Case -> `Spec` fields other than the defaults."""


def llama_logits(
  path: str, prompt: list[int], n_new: int, f32_cache: bool
) -> tuple[np.ndarray, np.ndarray]:
  """llama.cpp's (logits (len(prompt) + n_new - 1, vocab) float32, tokens (prompt + n_new
  greedy,) int32) on `path`: the prompt in one batch, then one token at a time."""
  from llama_cpp import Llama

  cache = dict(type_k=0, type_v=0) if f32_cache else {}
  llm = Llama(
    model_path=path,
    n_ctx=N_CTX,
    n_batch=N_CTX,
    logits_all=True,
    n_threads=2,
    flash_attn=False,
    verbose=False,
    **cache,
  )
  llm.eval(prompt)
  tokens = list(prompt)
  for step in range(n_new):
    tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    if step < n_new - 1:
      llm.eval([tokens[-1]])
  return np.array(llm.scores[: llm.n_tokens], np.float32), np.asarray(tokens, np.int32)


def run_llama(python: str, path: Path, prompt: list[int], f32_cache: bool) -> dict:
  """`llama_logits` in a child process of `python` (-> {'logits', 'tokens'})."""
  out = path.with_suffix(".f32.npz" if f32_cache else ".f16.npz")
  args = [str(path), json.dumps(prompt), str(N_NEW), str(int(f32_cache)), str(out)]
  subprocess.run([python, __file__, "--child", *args], check=True)
  with np.load(out) as z:
    return {k: z[k] for k in z.files}


def rel_gap(got: np.ndarray, ref: np.ndarray) -> float:
  """Max over positions of max |got - ref| / max |ref|."""
  got, ref = got.astype(np.float64), ref.astype(np.float64)
  return float((np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--llama-python", default=sys.executable, help="a Python with llama_cpp")
  parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf_models")
  args = parser.parse_args()
  sys.path.insert(0, str(ROOT))
  from tests import gpt_oss_gguf_writer as writer

  version = subprocess.run(
    [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
    check=True,
    capture_output=True,
    text=True,
  ).stdout.strip()
  refs: dict[str, object] = {"llama_cpp_version": version}
  with tempfile.TemporaryDirectory() as tmp:
    for case, fields in CASES.items():
      spec = writer.Spec(**fields)
      path = writer.write(Path(tmp) / f"{case}.gguf", spec)
      prompt = writer.prompt(spec, N_PROMPT)
      f32 = run_llama(args.llama_python, path, prompt, f32_cache=True)
      f16 = run_llama(args.llama_python, path, prompt, f32_cache=False)
      refs.update(
        {
          f"{case}_spec": json.dumps(dataclasses.asdict(spec)),
          f"{case}_weights_sha256": writer.weights_sha256(writer.weights(spec)),
          f"{case}_n_prompt": N_PROMPT,
          f"{case}_tokens": f32["tokens"],
          f"{case}_logits": f32["logits"],
        }
      )
      same = f16["tokens"].tolist() == f32["tokens"].tolist()
      gap = rel_gap(f16["logits"], f32["logits"]) if same else float("nan")
      print(
        f"{case}: dim {spec.dim}, {spec.heads} heads x {spec.head_dim}, {spec.layers} layers;"
        f" greedy {f32['tokens'][N_PROMPT:].tolist()}; f16-cache gap {gap:.2e}"
        + ("" if same else " (the F16 cache's greedy tokens differ)")
      )
  args.out.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(args.out / NAME, **refs)
  print(f"wrote {args.out / NAME} (llama-cpp-python {version})")


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
  path, prompt, n_new, f32, out = sys.argv[2:]
  logits, tokens = llama_logits(path, json.loads(prompt), int(n_new), f32 == "1")
  np.savez(out, logits=logits, tokens=tokens)
elif __name__ == "__main__":
  main()
