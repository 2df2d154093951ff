"""load_gguf on a ~1 GB Q8_0 llama file: load time vs reading the file, peak host memory,
and CPU decode tokens/s, against llama.cpp's on the same file when `--llama-cpp-python PY`
names a Python with llama-cpp-python. That llama.cpp must be built for this CPU
(`CMAKE_ARGS="-DGGML_NATIVE=ON"`): its `llama_print_system_info()` is printed and written
with the table, and no ratio is reported when it lacks a SIMD feature the CPU has
(`benchmarks/llamacpp_native.py`).

    python benchmarks/bench_gguf.py [--file /tmp/bench-q8_0.gguf] [--llama-cpp-python /work/venv-llamacpp/bin/python]

The file (TinyLlama-1.1B's shapes, `benchmarks/shapes.py`: 22 layers, dim 2048, ffn 5632,
32 heads / 4 KV heads; the tiny test vocabulary) is written once with random Q8_0 blocks (random int8 values and
float16 scales: valid Q8_0 data, no float weights needed). Each measurement runs
in a fresh interpreter. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.llamacpp_native import describe, query, refusal  # noqa: E402
from benchmarks.results_md import load_average, machine, markers, write_section  # noqa: E402
from benchmarks.shapes import TINYLLAMA_1B  # noqa: E402

MODEL = TINYLLAMA_1B  # its vocabulary aside: the file takes the tiny test file's
GGUF_NAMES = {
  "attn_norm": None,
  "q": "attn_q",
  "k": "attn_k",
  "v": "attn_v",
  "o": "attn_output",
  "ffn_norm": None,
  "gate": "ffn_gate",
  "up": "ffn_up",
  "down": "ffn_down",
}
"""A block's tensors in file order: `benchmarks/shapes.py`'s layer -> GGUF name (None: a norm)."""


def make_file(path: Path, model: Any = MODEL, vocab: int | None = None, tied: bool = False) -> None:
  """Write `model`'s shapes (a `benchmarks.shapes.Decoder`) as a llama Q8_0 GGUF with random
  blocks; the tiny test file's tokenizer, its token list padded to `vocab` entries (None: the
  tiny file's 384) with made-up tokens. `tied`: no output.weight (the embedding is reused)."""
  import gguf

  tiny = gguf.GGUFReader(ROOT / "tests/data/gguf_models/tiny-llama-q8_0.gguf")
  rng = np.random.default_rng(0)
  d, hd = model.dim, model.head_dim
  tiny_vocab = len(tiny.fields["tokenizer.ggml.tokens"].contents())
  vocab = vocab or tiny_vocab
  pad = vocab - tiny_vocab
  shapes = {"token_embd.weight": (vocab, d)}
  for i in range(model.layers):
    for layer, name in GGUF_NAMES.items():
      # GGUF's [N, K] of shapes.py's (K, N); a norm is (dim,)
      shape = (d,) if name is None else model.shape(layer)[::-1]
      shapes[f"blk.{i}.{name or layer}.weight"] = shape
  shapes |= {"output_norm.weight": (d,)} | ({} if tied else {"output.weight": (vocab, d)})
  tmp = path.with_suffix(".tmp")
  w = gguf.GGUFWriter(tmp, "llama")
  for key, field in tiny.fields.items():
    if key.startswith(("GGUF.", "llama.")) or key == "general.architecture":
      continue
    vt = gguf.GGUFValueType(field.types[0])
    sub = gguf.GGUFValueType(field.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
    value = field.contents()
    if key == "tokenizer.ggml.tokens":
      value = value + [f"\u27e8{i}\u27e9" for i in range(pad)]
    elif key == "tokenizer.ggml.token_type":
      value = value + [1] * pad
    w.add_key_value(key, value, vt, sub)
  w.add_context_length(2048)
  w.add_embedding_length(d)
  w.add_block_count(model.layers)
  w.add_feed_forward_length(model.ffn)
  w.add_head_count(model.heads)
  w.add_head_count_kv(model.kv_heads)
  w.add_rope_dimension_count(hd)
  w.add_layer_norm_rms_eps(1e-5)
  blk = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
  q8 = gguf.GGMLQuantizationType.Q8_0
  for name, shape in shapes.items():
    if len(shape) == 1:
      w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
    else:
      w.add_tensor_info(
        name,
        (shape[0], shape[1] // 32 * 34),
        np.dtype(np.uint8),
        shape[0] * shape[1] // 32 * 34,
        raw_dtype=q8,
      )
  w.write_header_to_file(tmp)
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  for shape in shapes.values():
    if len(shape) == 1:
      w.write_tensor_data(np.ones(shape, np.float32))
      continue
    b = np.empty(shape[0] * shape[1] // 32, blk)
    b["qs"] = rng.integers(-127, 128, b["qs"].shape, dtype=np.int8)
    b["d"] = (rng.uniform(0.5, 1.5, b.shape) * 0.02 / 127 / np.sqrt(shape[1] / 2048)).astype(
      np.float16
    )
    w.write_tensor_data(b.view(np.uint8).reshape(shape[0], -1))
  w.close()
  os.replace(tmp, path)


OURS = """
import json, os, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
import q8rules
jnp.zeros(1).block_until_ready()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def rss():
  for line in open('/proc/self/status'):
    if line.startswith('VmRSS'):
      return int(line.split()[1]) * 1024
t = time.perf_counter()
m = q8rules.load_gguf(sys.argv[1], dtype=jnp.float32, progress=False)
jax.block_until_ready(m.params)
load_s = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
after = rss()
ids = [0, 41, 70, 77, 77, 80, 222, 88]
stamps = []
for _ in m.stream(ids, 34):
  stamps.append(time.perf_counter())
decode_tps = (len(stamps) - 2) / (stamps[-1] - stamps[1])
prompt = [(7 * i + 3) % m.config.vocab for i in range(128)]
prefill = []
for _ in range(3):  # the first call compiles
  t = time.perf_counter()
  jax.block_until_ready(m.prefill(prompt))  # the head on the last position, as llama.cpp's eval
  prefill.append(time.perf_counter() - t)
prefill_tps = 128 / min(prefill[1:])
print(json.dumps(dict(load_s=load_s, base=base, peak=peak, after=after, decode_tps=decode_tps,
                      prefill_tps=prefill_tps)))
"""

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, n_batch=128, verbose=False)
ids = [0, 41, 70, 77, 77, 80, 222, 88]
llm.eval(ids)
stamps = []
for _ in range(34):
  t = int(llm.scores[llm.n_tokens - 1].argmax())
  llm.eval([t])
  stamps.append(time.perf_counter())
decode_tps = (len(stamps) - 2) / (stamps[-1] - stamps[1])
prompt = [(7 * i + 3) % llm.n_vocab() for i in range(128)]
prefill = []
for _ in range(3):
  llm.reset()
  t = time.perf_counter()
  llm.eval(prompt)
  prefill.append(time.perf_counter() - t)
print(json.dumps(dict(decode_tps=decode_tps, prefill_tps=128 / min(prefill[1:]))))
"""


def section_text(title: str, body: list[str]) -> str:
  """A RESULTS.md section: markers, title, date, machine, load, command, then `body`."""
  start, end = markers("gguf")
  head = [
    start,
    f"## {title}",
    "",
    f"- date: {datetime.date.today().isoformat()}; machine: {machine()}",
    f"- load average at the end: {load_average()}",
    f"- command: `python benchmarks/bench_gguf.py {' '.join(sys.argv[1:])}`",
    "",
  ]
  return "\n".join([*head, *body, end])


def read_file_s(path: Path) -> float:
  t = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    buf = bytearray(64 << 20)
    while f.readinto(buf):
      pass
  return time.perf_counter() - t


def run(py: str, code: str, path: Path) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run(
    [py, "-c", textwrap.dedent(code), str(path)],
    capture_output=True,
    text=True,
    env=env,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--file", default="/tmp/bench-q8_0.gguf")
  ap.add_argument("--llama-cpp-python", default=None)
  ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians)")
  ap.add_argument("--write", action="store_true", help="write the table to benchmarks/RESULTS.md")
  args = ap.parse_args()
  path = Path(args.file)
  if not path.exists():
    make_file(path)
  size = path.stat().st_size
  read_s = min(read_file_s(path) for _ in range(2))
  runs_ours, runs_theirs = [], []
  for _ in range(args.rounds):  # interleaved, so both sides see the same machine
    runs_ours.append(run(sys.executable, OURS, path))
    if args.llama_cpp_python:
      runs_theirs.append(run(args.llama_cpp_python, LLAMA_CPP, path))
  ours = {k: statistics.median(r[k] for r in runs_ours) for k in runs_ours[0]}
  build, missing = "", []
  if args.llama_cpp_python:
    build, missing = describe(**query(args.llama_cpp_python))
    print(build)
  rows = [
    ("file", f"{size / 1e9:.3f} GB Q8_0 ({MODEL.layers} layers, dim {MODEL.dim})"),
    ("read the file (page cache warm)", f"{read_s:.2f} s"),
    ("load_gguf", f"{ours['load_s']:.2f} s ({ours['load_s'] / read_s:.2f}x the read)"),
    (
      "peak RSS during load, minus RSS before",
      f"{(ours['peak'] - ours['base']) / 1e9:.3f} GB ({(ours['peak'] - ours['base']) / size:.2f}x the file)",
    ),
    ("RSS after load", f"{ours['after'] / 1e9:.3f} GB"),
    ("decode at batch 1, q8rules (float32 activations)", f"{ours['decode_tps']:.1f} tokens/s"),
    ("prefill of 128 tokens, q8rules", f"{ours['prefill_tps']:.0f} tokens/s"),
  ]
  if runs_theirs:
    theirs = {k: statistics.median(r[k] for r in runs_theirs) for k in runs_theirs[0]}
    rows += [
      ("decode at batch 1, llama.cpp (2 threads)", f"{theirs['decode_tps']:.1f} tokens/s"),
      ("prefill of 128 tokens, llama.cpp (2 threads)", f"{theirs['prefill_tps']:.0f} tokens/s"),
    ]
    if missing:  # a ratio against a build that lacks this CPU's SIMD says nothing
      rows += [("q8rules / llama.cpp", refusal(missing))]
    else:
      rows += [
        ("decode: q8rules / llama.cpp", f"{ours['decode_tps'] / theirs['decode_tps']:.2f}x"),
        ("prefill: q8rules / llama.cpp", f"{ours['prefill_tps'] / theirs['prefill_tps']:.2f}x"),
      ]
  table = ["| measure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
  print("\n".join(table))
  if args.write:
    body = [
      f"Medians of {args.rounds} interleaved rounds, each in a fresh interpreter; both sides on",
      "the same file with 2 threads (XLA's CPU pool and the native kernel's; llama.cpp's",
      "n_threads=2). q8rules keeps activations float32; llama.cpp rounds them to 8 bits.",
      "",
      *([build, ""] if build else []),
      *table,
    ]
    write_section("gguf", section_text("load_gguf and llama.cpp on one Q8_0 file (CPU)", body))


if __name__ == "__main__":
  main()
