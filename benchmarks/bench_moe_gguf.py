"""MoE GGUF files on the CPU: load, decode and prefill against llama.cpp on the same file, and
the decode's read bandwidth counted over the routed bytes only.

    python benchmarks/bench_moe_gguf.py --llama-cpp-python /work/venv-llamacpp/bin/python \
        [--models qwen3moe,gpt-oss,gpt-oss-q8_0] [--rounds 2] [--dir /tmp] [--write]

Files (`benchmarks/moe_files.py`, written once into --dir): Qwen3-30B-A3B's layer shapes (128
experts, top 8, dim 2048, expert FFN 768) in Q8_0, 8 of its 48 layers; gpt-oss-20b's (32
experts, top 4, dim 2880) with MXFP4 experts as its files ship, 4 of its 24 layers; both with
Qwen's real 151,936-token vocabulary. q8rules requantizes MXFP4 to Q8_0 at load; llama.cpp
runs MXFP4 as stored, so on that file the two read different bytes (both are given);
`gpt-oss-q8_0` is the same file with Q8_0 experts, where both read the same bytes.

Each measurement is a fresh interpreter, ours and llama.cpp's interleaved round by round (each
round starting with the next runner), 2
threads each (XLA's pool and the native kernels; llama.cpp's n_threads=2); medians. Decode:
32 greedy tokens after the first, which follows an 8-token prompt (q8rules: its second run,
the first compiles; it decodes on the device in chunks, so the rate is the tokens over the
time from the first token to the last). Prefill: a 128-token prompt's forward pass with the
output head on its last position (`GGUFModel.prefill`, as `stream` runs it; llama.cpp's `eval`
computes that position's logits only too). Routed bytes: what one decode
step must read (every tensor but the expert stacks, `used` experts of each stack, one row of
the embedding table): over the step's time, as a fraction of `bandwidth.py`'s read probe.
Peak RSS is the process's high-water mark minus its RSS before the model, against the file.
q8rules runs twice a round: weight-only (the default, float32-accurate products) and with
`act_qtype='q8_0'` (activations quantized to Q8_0 as llama.cpp does: its own arithmetic, int8
block dots on the CPU's SIMD path (AVX-512 VNNI, AVX2, NEON), the experts' included).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bandwidth import read_bandwidth  # noqa: E402
from benchmarks.bench_gguf import read_file_s, run  # noqa: E402
from benchmarks.llamacpp_native import describe, query, refusal  # noqa: E402
from benchmarks.moe_files import GPT_OSS_20B, QWEN3_30B_A3B, MoeShape, make_file  # noqa: E402
from benchmarks.results_md import load_average, machine, markers, write_section  # noqa: E402

MODELS = {
  "qwen3moe": QWEN3_30B_A3B,
  "gpt-oss": GPT_OSS_20B,
  "gpt-oss-q8_0": dataclasses.replace(GPT_OSS_20B, expert_type="Q8_0"),
}

OURS = """
import json, resource, sys, time
import jax, jax.numpy as jnp
import q8rules
jnp.zeros(1).block_until_ready()
def rss():
  for line in open('/proc/self/status'):
    if line.startswith('VmRSS'):
      return int(line.split()[1]) * 1024
base = rss()
t = time.perf_counter()
m = q8rules.load_gguf(sys.argv[1], dtype=jnp.float32, progress=False, act_qtype=ACT_QTYPE)
jax.block_until_ready(m.params)
load_s = time.perf_counter() - t
ids = [9707, 11, 1879, 0, 576, 3974, 13876, 38835]
decode = []
for _ in range(2):  # the first run compiles
  ready = []
  n = sum(1 for _ in m.stream(ids, 33, on_prefill=lambda: ready.append(time.perf_counter())))
  decode.append((n - 1) / (time.perf_counter() - ready[0]))
decode_tps = decode[-1]
prompt = [(7919 * i + 3) % 150000 for i in range(128)]
prefill = []
for _ in range(3):  # the first call compiles
  t = time.perf_counter()
  jax.block_until_ready(m.prefill(prompt))
  prefill.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(load_s=load_s, rss=peak - base, decode_tps=decode_tps,
                      prefill_tps=128 / min(prefill[1:]))))
"""

LLAMA_CPP = """
import json, resource, sys, time
from llama_cpp import Llama
def rss():
  for line in open('/proc/self/status'):
    if line.startswith('VmRSS'):
      return int(line.split()[1]) * 1024
base = rss()
t = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, n_batch=128, verbose=False,
            use_mmap=False)
load_s = time.perf_counter() - t
ids = [9707, 11, 1879, 0, 576, 3974, 13876, 38835]
llm.eval(ids)
stamps = []
for _ in range(34):
  llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
  stamps.append(time.perf_counter())
decode_tps = (len(stamps) - 2) / (stamps[-1] - stamps[1])
prompt = [(7919 * i + 3) % 150000 for i in range(128)]
prefill = []
for _ in range(3):
  llm.reset()
  t = time.perf_counter()
  llm.eval(prompt)
  prefill.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(load_s=load_s, rss=peak - base, decode_tps=decode_tps,
                      prefill_tps=128 / min(prefill[1:]))))
"""


def _median(runs: list[dict]) -> dict:
  return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _routed_q8_bytes(shape: MoeShape, vocab: int) -> int:
  """Routed bytes of `shape` once its experts are Q8_0 (what q8rules reads per step)."""
  return dataclasses.replace(shape, expert_type="Q8_0").routed_bytes(vocab)


def bench(name: str, shape: MoeShape, folder: Path, args: argparse.Namespace) -> list[str]:
  """One model's rows: (measure, q8rules, llama.cpp, ratio)."""
  path = folder / f"bench-{name}-{shape.layers}l.gguf"
  if not path.exists():
    print(f"writing {path} ...", flush=True)
    make_file(path, shape)
  size = path.stat().st_size
  read_s = min(read_file_s(path) for _ in range(2))
  runs: dict[str, list[dict]] = {"ours": [], "act": [], "theirs": []}
  commands = {
    "ours": (sys.executable, OURS.replace("ACT_QTYPE", "None")),
    "act": (sys.executable, OURS.replace("ACT_QTYPE", "'q8_0'")),
    "theirs": (args.llama_cpp_python, LLAMA_CPP),
  }
  runners = list(commands)
  for r in range(args.rounds):  # each round starts with the next runner: no one always first
    first = r % len(runners)
    for runner in runners[first:] + runners[:first]:
      runs[runner].append(run(*commands[runner], path))
  ours, act, theirs = runs["ours"], runs["act"], runs["theirs"]
  o, a, t = _median(ours), _median(act), _median(theirs)
  vocab = 151936
  probe = args.probe
  ours_bytes, their_bytes = _routed_q8_bytes(shape, vocab), shape.routed_bytes(vocab)
  ours_bw, their_bw = o["decode_tps"] * ours_bytes / 1e9, t["decode_tps"] * their_bytes / 1e9
  act_bw = a["decode_tps"] * ours_bytes / 1e9
  label = f"{name} ({shape.layers} of {shape.real_layers} layers, {shape.experts} experts top {shape.used}, {shape.expert_type} experts), {size / 1e9:.2f} GB, read {read_s:.1f} s"

  def ratio(key: str, faster_is_smaller: bool = False) -> str:
    pair = [(t[key] / x[key]) if faster_is_smaller else (x[key] / t[key]) for x in (o, a)]
    return " | ".join(f"{r:.2f}x" for r in pair)

  rows = [
    f"| {label} | | | | | |",
    f"| load s | {o['load_s']:.1f} | {a['load_s']:.1f} | {t['load_s']:.1f} | {ratio('load_s', True)} |",
    f"| decode tokens/s | {o['decode_tps']:.2f} | {a['decode_tps']:.2f} | {t['decode_tps']:.2f} | {ratio('decode_tps')} |",
    f"| prefill-128 tokens/s | {o['prefill_tps']:.1f} | {a['prefill_tps']:.1f} | {t['prefill_tps']:.1f} | {ratio('prefill_tps')} |",
    f"| routed bytes per step (MB) | {ours_bytes / 1e6:.0f} | {ours_bytes / 1e6:.0f} | {their_bytes / 1e6:.0f} | | |",
    f"| decode GB/s over routed bytes (of the {probe:.1f} GB/s read probe) | {ours_bw:.1f} ({ours_bw / probe:.0%}) | {act_bw:.1f} ({act_bw / probe:.0%}) | {their_bw:.1f} ({their_bw / probe:.0%}) | | |",
    f"| peak RSS - RSS before, GB (x the file) | {o['rss'] / 1e9:.2f} ({o['rss'] / size:.2f}x) | {a['rss'] / 1e9:.2f} ({a['rss'] / size:.2f}x) | {t['rss'] / 1e9:.2f} ({t['rss'] / size:.2f}x) | | |",
  ]
  print("\n".join(rows), flush=True)
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--llama-cpp-python", required=True)
  ap.add_argument("--models", default="qwen3moe,gpt-oss,gpt-oss-q8_0")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--dir", default="/tmp")
  ap.add_argument("--write", action="store_true", help="write the table to benchmarks/RESULTS.md")
  ap.add_argument("--section", default="moe-gguf", help="RESULTS.md section (e.g. moe-gguf-avx2)")
  args = ap.parse_args()
  build, missing = describe(**query(args.llama_cpp_python))
  print(build)
  if missing:
    raise SystemExit(refusal(missing))
  args.probe = read_bandwidth(2, gib=2.0)
  header = [
    "| measure | q8rules | q8rules, act_qtype='q8_0' | llama.cpp | q8rules / llama.cpp | act_qtype='q8_0' / llama.cpp |",
    "|---|---|---|---|---|---|",
  ]
  rows = []
  for name in args.models.split(","):
    rows += bench(name, MODELS[name], Path(args.dir), args)
  table = [*header, *rows]
  print("\n".join(table))
  if args.write:
    start, end = markers(args.section)
    text = [
      start,
      "## MoE GGUF files against llama.cpp (CPU)",
      "",
      f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {machine()}",
      f"- load average at the end: {load_average()}",
      f"- command: `python benchmarks/bench_moe_gguf.py {' '.join(sys.argv[1:])}`",
      f"- {build}",
      "",
      __doc__.split("\n\n", 2)[2].strip(),
      "",
      *table,
      end,
    ]
    write_section(args.section, "\n".join(text))


if __name__ == "__main__":
  main()
