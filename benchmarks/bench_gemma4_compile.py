"""Compile time and decode step of a Gemma-4-E2B-shaped model (35 layers, unrolled: per-layer
embeddings, the last 20 layers sharing KV, FFN widths per layer, local / global every 5th) against
a scanned model of the same depth (gemma3, 35 layers, the same small dims) and that model
unrolled, in one process.

    python benchmarks/bench_gemma4_compile.py [--dim 64] [--rounds 3] [--write]

The files are written to a temporary folder (Q8_0, random weights, scripts/gguf_gemma4.py's and
scripts/make_gguf_references.py's layouts at E2B's depth and pattern). "first stream" is the
first `stream(prompt, 17)` of a loaded model: tracing and compiling the prefill, the first token
and the decode loop, then running them (the run itself is milliseconds at these dims).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import gguf_gemma4 as g4  # noqa: E402
import make_gguf_references as ref  # noqa: E402

import q8rules  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from q8rules.llm.unstack import unrolled  # noqa: E402

LAYERS, SHARED = 35, 20
"""Gemma 4 E2B's depth and its layers that reuse earlier layers' KV."""
PROMPT = [2, 41, 70, 77, 77, 80, 222, 88]


def e2b_file(out: Path, dim: int) -> Path:
  """A Q8_0 gemma4 file of E2B's structure at width `dim` (FFN 2 dim, 4 dim on shared layers)."""
  own = LAYERS - SHARED
  cfg = dict(
    g4.CONFIGS["gemma4-e2b"],
    dim=dim,
    layers=LAYERS,
    pattern=tuple(i % 5 != 4 for i in range(LAYERS)),
    kv_heads=(1,) * LAYERS,
    ffn=(2 * dim,) * own + (4 * dim,) * SHARED,
    shared_kv=SHARED,
  )
  path = out / "e2b-35l-q8_0.gguf"
  g4.write(path, cfg, g4.make_weights(cfg, 0), g4.gemma4_vocab(), q8=True)
  return path


def gemma3_file(out: Path, dim: int) -> Path:
  """A Q8_0 gemma3 file (scanned by load_gguf) of the same depth and width."""
  cfg = dict(ref.MODELS["gemma3"], dim=dim, layers=LAYERS, ffn=2 * dim)
  # a byte-level vocabulary without merges (the model's numbers do not depend on it)
  alphabet = sorted(chr(c) for c in range(33, 127))
  tokens = ["<|bos|>", "<|eos|>", *alphabet, *(f"x{i}" for i in range(cfg["vocab"] - 96))]
  vocab = (tokens, [], {"<|bos|>": 0, "<|eos|>": 1})
  path = out / "gemma3-35l-q8_0.gguf"
  ref.write_gguf(path, cfg, ref.make_weights(cfg, len(vocab[0]), 0), vocab, q8=True)
  return path


def decode_step_ms(m, n: int = 33) -> float:
  """ms per decode step: from the first streamed token to the last, over the steps between
  (the stream hands out tokens in runs of several steps)."""
  stamps = [time.perf_counter() for _ in m.stream(PROMPT, n)]
  return 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args()
  jax.config.update("jax_compilation_cache_dir", None)
  with tempfile.TemporaryDirectory() as d:
    files = {"gemma4 (E2B-shaped)": e2b_file(Path(d), args.dim)}
    files["gemma3 (scanned)"] = gemma3_file(Path(d), args.dim)
    models = {}
    for name, path in files.items():
      t = time.perf_counter()
      models[name] = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
      print(f"{name}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
    models["gemma3 unrolled"] = unrolled(models["gemma3 (scanned)"])
    first = {}
    for name, m in models.items():
      t = time.perf_counter()
      list(m.stream(PROMPT, 17))
      first[name] = time.perf_counter() - t
      print(f"{name}: first stream {first[name]:.1f} s", flush=True)
    steps: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
      for name, m in models.items():
        steps[name].append(decode_step_ms(m))
  rows = [
    f"| {name} | {m.config.layers} | {'yes' if m.config.scan_layers else 'no'} |"
    f" {first[name]:.1f} | {statistics.median(steps[name]):.2f} |"
    for name, m in models.items()
  ]
  table = "\n".join(
    [
      "| model | layers | scanned | first stream (trace + compile) s | decode step ms |",
      "|---|---:|---|---:|---:|",
      *rows,
    ]
  )
  g4_name, scanned = "gemma4 (E2B-shaped)", "gemma3 (scanned)"
  note = (
    f"The unrolled Gemma 4 takes {first[g4_name] / first[scanned]:.1f}x the scanned model's first"
    f" stream ({first[g4_name]:.1f} s against {first[scanned]:.1f} s); the same gemma3 unrolled"
    f" {first['gemma3 unrolled'] / first[scanned]:.1f}x: the cost is the unrolling, about"
    f" {1e3 * (first['gemma3 unrolled'] - first[scanned]) / LAYERS:.0f} ms of trace and compile"
    " per unrolled layer."
  )
  print(table)
  print(note)
  print(f"load average at the end: {load_average()}")
  if args.write:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    header = (
      f"Date: {now}. Machine: {machine()}. Load average at the end: {load_average()} (shared"
      f" 2-core machine). dim {args.dim}, Q8_0, float32 activations, 2 threads, compilation"
      f" cache off; decode step: median of {args.rounds} interleaved rounds of 32 steps."
    )
    cmd = "python " + " ".join(["benchmarks/bench_gemma4_compile.py", *sys.argv[1:]])
    write_section(
      "gemma4-compile",
      section(
        "gemma4-compile",
        "## Gemma 4 (E2B-shaped, 35 layers unrolled): compile time and decode step",
        header,
        cmd,
        [table, note],
      ),
    )


if __name__ == "__main__":
  main()
