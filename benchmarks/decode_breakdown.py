"""Where a decode step of a GGUF model goes on the CPU: XLA's profiler over the decode loop (the
device program `GGUFModel.stream` runs), each op's time per step by kind, with the bytes each
kind of Q8_0 product reads and its rate against the read probe.

    python benchmarks/decode_breakdown.py FILE [--tokens 32] [--threads 2] [--top 0] [--act-qtype q8_0]
    python benchmarks/decode_breakdown.py FILE --serve-rows 4 [...]   # the server's batched step

With `--serve-rows P` the step measured is `q8rules serve`'s (`engine.runner.BatchRunner`'s
device program: P slots, every one decoding, greedy, `--steps` decode steps a program as the
server runs them) instead of `GGUFModel.stream`'s one row.

Kinds: the output head (the one product outside the layers), the layers' products (q | k | v
and the output projection; a dense model's FFN too), the expert products (op
'ragged_matmul': the routed experts' rows), the one-token attention (op 'decode_attention'),
then XLA's own ops, split by where the model makes them (the MoE block: router, top-k, expert
weighting and sums; the attention block: biases, RoPE, KV writes; the rest: norms, residuals,
the embedding row, sampling, the loop). Op times are the profiler's, summed over every thread
per step; "wall" is a stream of the same tokens without the profiler, and what the ops leave
of it is dispatch, launches and the host. Bytes per step come from each product's operands in
the compiled program (int8 values and float16 scales; an expert product reads one expert per
routed row). `--top N` also lists the N XLA ops (not the kernels) that take the most time a
step, each with its opcode, output shape and where the model makes it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [9707, 11, 1879, 0, 576, 3974, 13876, 38835]

CUSTOM = {
  "q8rules_q8_gemv": "output head",
  "q8rules_q8_gemv_act_q8": "output head",
  "q8rules_q8_gemv_layer": "layer products",
  "q8rules_q8_gemv_act_q8_layer": "layer products",
  "q8rules_q8_ragged_matmul": "expert products",
  "q8rules_q8_ragged_matmul_act_q8": "expert products",
  "q8rules_decode_attention": "one-token attention",
}
"""Custom-call target -> kind."""

CONTAINERS = {"while", "conditional", "call"}
"""Opcodes whose events hold other ops' (not counted: their ops are)."""

LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+) = (.*)$")
SHAPE = re.compile(r"(s8|f16|f32|bf16)\[([\d,]*)\]")


def instructions(text: str) -> dict[str, dict]:
  """HLO text -> {name: {opcode, target, op_name, operands (shapes in the layout
  constraints), out (the result's dims)}}."""
  out = {}
  for line in text.splitlines():
    m = LINE.match(line)
    if not m:
      continue
    name, rest = m.groups()
    op = re.search(r"\s([a-z][\w\-]*)\(", rest)
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    op_name = re.search(r'op_name="([^"]+)"', rest)
    layout = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", rest)
    first = SHAPE.search(rest)
    out[name] = dict(
      opcode=op.group(1) if op else "",
      target=target.group(1) if target else None,
      op_name=op_name.group(1) if op_name else "",
      operands=SHAPE.findall(layout.group(1)) if layout else [],
      out=[int(d) for d in first.group(2).split(",") if d] if first else [],
    )
  return out


def kind_of(ins: dict) -> str | None:
  """The kind an instruction's time goes to (None: a container)."""
  if ins["opcode"] in CONTAINERS:
    return None
  if ins["target"] in CUSTOM:
    return CUSTOM[ins["target"]]
  where = ins["op_name"]
  if "/moe/" in where:
    return "XLA ops of the MoE block (router, top-k, weights, sums)"
  if "/attn/" in where:
    return "XLA ops of the attention block (biases, RoPE, KV writes)"
  return "other XLA ops (norms, residuals, embedding, sampling, loop)"


def product_bytes(ins: dict) -> int:
  """Bytes one call of a Q8_0 product reads: int8 values and float16 scales of its weight (one
  layer of a stacked one; one expert per routed row of an expert stack)."""
  dims = {
    dt: [int(d) for d in s.split(",") if d] for dt, s in ins["operands"] if dt in ("s8", "f16")
  }
  q, s = dims.get("s8"), dims.get("f16")
  if not q or not s:
    return 0
  k, n = q[-2], q[-1]
  per = k * n + s[-2] * n * 2
  if ins["target"] in ("q8rules_q8_ragged_matmul", "q8rules_q8_ragged_matmul_act_q8"):
    rows = [int(d) for dt, sh in ins["operands"] if dt == "f32" for d in sh.split(",") if d][0]
    return per * min(rows, q[0])
  return per


def serve_steps(m, rows: int, steps: int, total: int):
  """A function that runs `total` decode steps of the server's batched program on `rows`
  slots, every one decoding (each slot prefilled with PROMPT, greedy), and returns ms a step."""
  import numpy as np

  from q8rules.engine.runner import BatchRunner
  from q8rules.engine.sampling import HISTORY, RowSettings

  runner = BatchRunner(m, slots=rows, context=len(PROMPT) + 4 * total + 8, steps=steps)
  key, history = np.zeros((2,), np.uint32), np.full((HISTORY,), -1, np.int32)

  def run() -> float:
    for slot in range(rows):
      runner.free(slot)
      runner.prefill(slot, np.asarray(PROMPT, np.int32), 0, key, history, RowSettings.empty(1),
                     last=True).fetch(False)  # fmt: skip
    start, done = time.perf_counter(), 0
    while done < total:
      n = min(steps, total - done)
      runner.decode(n).fetch(False)
      done += n
    return (time.perf_counter() - start) * 1e3 / total

  return run


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("file")
  ap.add_argument("--tokens", type=int, default=32, help="decode steps measured")
  ap.add_argument("--threads", type=int, default=2, help="the read probe's threads")
  ap.add_argument("--top", type=int, default=0, help="list the N slowest XLA ops")
  ap.add_argument("--act-qtype", default=None, choices=("q8_0",), help="load_gguf's act_qtype")
  ap.add_argument("--serve-rows", type=int, default=0, help="the server's step with P rows")
  ap.add_argument("--steps", type=int, default=4, help="decode steps a server program runs")
  args = ap.parse_args()
  dump = tempfile.mkdtemp(prefix="decode-breakdown-")
  module = "jit__decode_steps"  # run's and serve's decode: the engine runner's program
  flags = (
    f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*{module.removeprefix('jit_')}.*"
    " --xla_dump_hlo_as_text"
  )
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()

  import jax
  import jax.numpy as jnp
  from jax.profiler import ProfileData

  import q8rules
  from benchmarks.bandwidth import read_bandwidth

  m = q8rules.load_gguf(args.file, dtype=jnp.float32, progress=False, act_qtype=args.act_qtype)
  steps = args.tokens

  def stream() -> float:
    """ms per decode step (first token to last)."""
    ready = []
    n = sum(
      1 for _ in m.stream(PROMPT, steps + 1, on_prefill=lambda: ready.append(time.perf_counter()))
    )
    return (time.perf_counter() - ready[0]) * 1e3 / (n - 1)

  if args.serve_rows:
    stream = serve_steps(m, args.serve_rows, args.steps, steps)
  stream()  # compiles
  wall = min(stream() for _ in range(3))
  trace = tempfile.mkdtemp(prefix="decode-breakdown-trace-")
  jax.profiler.start_trace(trace)
  traced = stream()
  jax.profiler.stop_trace()
  hlo = sorted(glob.glob(f"{dump}/*{module}*after_optimizations.txt"))
  ins = instructions(Path(hlo[-1]).read_text())
  pb = max(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
  ms, calls, each = collections.Counter(), collections.Counter(), collections.Counter()
  for plane in ProfileData.from_file(pb).planes:
    for line in plane.lines:
      for ev in line.events:
        stats = dict(ev.stats)
        if stats.get("hlo_module") != module or ev.name not in ins:
          continue
        kind = kind_of(ins[ev.name])
        if kind is not None:
          ms[kind] += ev.duration_ns / 1e6 / steps
          calls[ev.name] += 1
          each[ev.name] += ev.duration_ns / 1e6 / steps
  read = collections.Counter()
  for name, n in calls.items():
    if ins[name]["target"] in CUSTOM:
      read[kind_of(ins[name])] += product_bytes(ins[name]) * n / steps
  probe = read_bandwidth(args.threads, gib=2.0)
  c = m.config
  what = (
    f"the server's step, {args.serve_rows} rows ({args.steps} steps a program)"
    if args.serve_rows
    else "decode"
  )
  rate = max(args.serve_rows, 1) * 1e3 / wall
  rows = [
    f"{Path(args.file).name}: {c.arch}, {c.layers} layers, dim {c.dim}, vocab {c.vocab}; {what}"
    f" {rate:.1f} tokens/s ({wall:.2f} ms a step; {traced:.2f} under the profiler, which"
    f" the shares are of); read probe {probe:.1f} GB/s ({args.threads} threads)",
    "",
    "| kind | ms / step | share | MB / step | GB/s (of the probe) |",
    "|---|---|---|---|---|",
  ]
  for kind, t in ms.most_common():
    mb = read.get(kind, 0) / 1e6
    rate = f"{mb:.0f} | {mb / t:.1f} ({mb / t / probe:.0%})" if mb else " | "
    rows.append(f"| {kind} | {t:.2f} | {t / traced:.0%} | {rate} |")
  rest = traced - sum(ms.values())
  rows.append(f"| between ops (dispatch, launches, host) | {rest:.2f} | {rest / traced:.0%} | | |")
  total = sum(read.values()) / 1e6
  rows.append(
    f"| the step | {traced:.2f} | 100% | {total:.0f} | {total / traced:.1f} ({total / traced / probe:.0%}) |"
  )
  t, mb = ms.get("expert products", 0.0), read.get("expert products", 0) / 1e6
  if mb:
    half = t / 2  # MXFP4: 17 bytes a block of 32 values against Q8_0's 34
    rows += [
      "",
      f"The expert products read {mb:.0f} MB a step of Q8_0 in {t:.2f} ms; as MXFP4 (17 bytes"
      f" a block of 32 values, not 34) at the same rate they would take {half:.2f} ms: a step"
      f" of {wall - half:.2f} ms, {1e3 / (wall - half):.1f} tokens/s.",
    ]
  xla_ops = [(n, t) for n, t in each.most_common() if ins[n]["target"] not in CUSTOM]
  if args.top:
    rows += [
      "",
      f"The {args.top} slowest XLA ops:",
      "",
      "| op | opcode | output | where | ms / step | calls / step |",
      "|---|---|---|---|---|---|",
    ]
    for name, t in xla_ops[: args.top]:
      i = ins[name]
      where = i["op_name"].split("/", 1)[-1][-70:]
      rows.append(
        f"| {name} | {i['opcode']} | {i['out']} | {where} | {t:.3f} | {calls[name] / steps:.0f} |"
      )
  print("\n".join(rows))


if __name__ == "__main__":
  main()
