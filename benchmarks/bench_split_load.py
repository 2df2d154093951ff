"""A split GGUF set loads as fast as the one file: `load_gguf` on bench_decode's 8-layer file
(b, 0.51 GB) and on the same tensors split into parts by gguf-py's writer (llama.cpp's
`gguf-split` layout), with the split reader's one-pass stacked and fused reads, and, for
comparison, with them turned off (every tensor read on its own and stacked afterwards, what a
split set took before the readers shared one interface).

    python benchmarks/bench_split_load.py [--parts 3] [--rounds 5] [--write]

Each load is a fresh interpreter on the page-cached files; medians of `--rounds`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_decode import FILES  # noqa: E402
from benchmarks.bench_gguf import make_file  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

LOAD = r"""
import json, sys, time
import jax
from q8rules.checkpoint.reader import CheckpointReader
from q8rules.checkpoint.gguf.split import GGUFSplitCheckpoint
if sys.argv[2] == "per-tensor":  # the split reader without its one-pass reads
  GGUFSplitCheckpoint.get_stacked = CheckpointReader.get_stacked
  GGUFSplitCheckpoint.get_fused = CheckpointReader.get_fused
import q8rules
t = time.perf_counter()
m = q8rules.load_gguf(sys.argv[1], progress=False)
jax.block_until_ready(m.params)
print(json.dumps(dict(load_s=time.perf_counter() - t)))
"""


def split(src: Path, parts: int) -> Path:
  """`src` rewritten as `parts` split files (gguf-py's writer, tensors spread evenly); the
  first part's path."""
  import gguf

  from tests._utils import copy_gguf

  first = src.with_name(f"{src.stem}-split-00001-of-{parts:05d}.gguf")
  if first.exists():
    return first
  n = len(gguf.GGUFReader(src).tensors)
  copy_gguf(src, src.with_name(f"{src.stem}-split.gguf"), split_max_tensors=-(-n // parts))
  return first


def load(path: Path, mode: str) -> float:
  out = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(LOAD), str(path), mode],
    capture_output=True,
    text=True,
    timeout=600,
    env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
  )
  if out.returncode:
    raise RuntimeError(out.stderr[-2000:])
  return json.loads(out.stdout.strip().splitlines()[-1])["load_s"]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dir", default="/tmp")
  ap.add_argument("--file", default="b", choices=sorted(FILES))
  ap.add_argument("--parts", type=int, default=3)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--write", action="store_true", help="write the table to RESULTS.md")
  args = ap.parse_args()
  name, shapes, vocab, tied = FILES[args.file]
  one = Path(args.dir) / name
  if not one.exists():
    make_file(one, shapes, vocab, tied)
  first = split(one, args.parts)
  runs = {"one file": [], "split": [], "split, per tensor": []}
  for _ in range(args.rounds):
    runs["one file"].append(load(one, "fast"))
    runs["split"].append(load(first, "fast"))
    runs["split, per tensor"].append(load(first, "per-tensor"))
  base = statistics.median(runs["one file"])
  rows = ["| file | load (s, median) | vs one file |", "|---|---|---|"]
  for key, times in runs.items():
    med = statistics.median(times)
    rows.append(f"| {key} | {med:.3f} | {med / base:.2f}x |")
  table = "\n".join(rows)
  print(f"{name} ({one.stat().st_size / 1e9:.2f} GB), {args.parts} parts, {args.rounds} rounds")
  print(table)
  if args.write:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    header = (
      f"Date: {now}. Machine: {machine()}. Load average at the end: {load_average()}."
      f" File {args.file}: {name}, {args.parts} parts."
    )
    cmd = "python " + " ".join(["benchmarks/bench_split_load.py", *sys.argv[1:]])
    write_section(
      "split-load", section("split-load", "## A split GGUF set's load", header, cmd, [table])
    )


if __name__ == "__main__":
  main()
