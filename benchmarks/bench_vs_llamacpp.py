"""q8rules' Q8_0 products against llama.cpp's, side by side in one process and one run.

    python benchmarks/bench_vs_llamacpp.py             # full grid, writes RESULTS.md
    python benchmarks/bench_vs_llamacpp.py --quick     # K = N = 4096 only, m in {1, 8}
    python benchmarks/bench_vs_llamacpp.py --no-write  # print the table only
    taskset -c 0 python benchmarks/bench_vs_llamacpp.py --quick --section vs-llamacpp-1cpu

Needs the `llama_cpp` package (llama-cpp-python, built for this CPU) in the same Python as jax
and q8rules, or a venv's site-packages given by `--llama-cpp-site` (appended to sys.path, so
only what the main environment lacks, llama_cpp, comes from there); it builds nothing itself,
and exits cleanly with a message when `llama_cpp` does not import. It prints
`llama_print_system_info()` and REFUSES to compare (prints no table) when the build lacks a
SIMD feature this CPU has (`benchmarks/llamacpp_native.py`: a non-native build is several
times slower than llama.cpp built for the machine).

Kernel level. For each (K, N) in {4096^2, 8192^2, 4096x14336, 14336x4096} (the q projections of
Llama-3-8B and -70B, Llama-3-8B's up and down: `benchmarks/shapes.py`) and m rows of x in
{1, 2, 4, 8, 16}, `y (m, N) = x (m, K) float32 @ W (K, N)` with W Q8_0 (int8 values, one
float16 scale per 32 rows, as GGUF stores it), timed three ways on the same weights:

  q8 cpu     `q8rules.q8_matmul(x, w, implementation='cpu')` under `jax.jit`: the native C++
             kernel (float32 activations, float32 block sums; the ISA path it picked is shown)
  q8 xla     `q8rules.q8_matmul(x, w, implementation='xla')`, for reference
  q8 act     `q8rules.q8_matmul(x, w, implementation='cpu', act_qtype='q8_0')`: the native
             kernel with x quantized to Q8_0 in the kernel (int8 block dots, AVX-512 VNNI where
             the CPU has it): llama.cpp's own numerics, opt-in (`q8rules.kernels.matmul_act_q8`)
  llama.cpp  ggml's own `mul_mat` of a Q8_0 weight and a float32 activation, run through
             ggml's CPU backend (`ggml_graph_plan` + `ggml_graph_compute`, the route llama.cpp's
             CPU backend takes for one matmul node; no repacking of Q8_0 exists on x86), called
             through ctypes on the libggml shipped inside llama_cpp. ggml quantizes x to Q8_0
             (8-bit activations) inside the op, as llama.cpp does; that cost is in its time.

Weights: several copies of each shape (distinct values), together at least twice the L3 size
the OS reports, and calls rotate through them, so every call reads its weight from DRAM. The
weights are the same bytes on both sides (ggml's 34-byte blocks are built from our q and
scale). Rounds sweep the whole grid, interleaving the three paths cell by cell (with a 20 ms
pause before each, so the other side's spinning threads, XLA's pool or ggml's OpenMP team, are
asleep); a cell's time is the least of its per-round medians, and the fastest single call is
reported too (on a shared machine ggml's OpenMP barriers suffer more from other processes than
the kernel's dynamically claimed work, which the medians then show). Overheads are measured and reported, not subtracted:
a tiny product (K = 32, N = 16, m = 1) on each side gives the per-call cost of dispatch
(jax.jit + XLA FFI; ctypes + ggml graph compute with its threadpool set-up).

Model level (tokens/s of decode and prefill on one Q8_0 GGUF file) is
`benchmarks/bench_gguf.py`, which runs `q8rules.load_gguf` and llama.cpp on the same file.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import q8rules  # noqa: E402
from benchmarks import results_md  # noqa: E402
from benchmarks.llamacpp_native import describe, query, refusal  # noqa: E402
from benchmarks.results_md import load_average, machine, write_section  # noqa: E402
from benchmarks.shapes import CPU_MATMUL, SQUARE  # noqa: E402
from q8rules.kernels.native import library as native_lib  # noqa: E402
from q8rules.kernels.native import simd as native_simd  # noqa: E402
from q8rules.timing import call_times, median_time  # noqa: E402

HEADING = "## CPU: q8rules vs llama.cpp (Q8_0 matmul)"
SHAPES = tuple(CPU_MATMUL.values())
QUICK_SHAPES = tuple(SQUARE.values())[:1]
ROWS = (1, 2, 4, 8, 16)
GGML_TYPE_F32 = 0
GGML_TYPE_Q8_0 = 8
BLOCK_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])  # ggml's block_q8_0, 34 bytes


def l3_bytes() -> int:
  """The largest cache the OS reports for CPU 0 (the L3 on x86), default 32 MiB."""
  best = 32 << 20
  base = Path("/sys/devices/system/cpu/cpu0/cache")
  for index in base.glob("index*"):
    try:
      text = (index / "size").read_text().strip()
    except OSError:
      continue
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    best = max(best, size)
  return best


def cpu_flags() -> str:
  """The SIMD flags of /proc/cpuinfo that matter to these kernels."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return "n/a"
  flags = next(
    (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
  )
  keep = [
    f
    for f in flags
    if f in ("avx2", "fma", "f16c") or f.startswith("avx512") or f.startswith("amx")
  ]
  return " ".join(keep) or "none"


class Ggml:
  """Just enough of ggml's C API (ctypes) to time one Q8_0 x float32 `mul_mat` on the CPU."""

  class InitParams(ctypes.Structure):
    _fields_ = [
      ("mem_size", ctypes.c_size_t),
      ("mem_buffer", ctypes.c_void_p),
      ("no_alloc", ctypes.c_bool),
    ]

  class CPlan(ctypes.Structure):
    _fields_ = [
      ("work_size", ctypes.c_size_t),
      ("work_data", ctypes.c_void_p),
      ("n_threads", ctypes.c_int),
      ("threadpool", ctypes.c_void_p),
      ("abort_callback", ctypes.c_void_p),
      ("abort_callback_data", ctypes.c_void_p),
      ("use_ref", ctypes.c_bool),
    ]

  def __init__(self, lib_dir: Path):
    mode = ctypes.RTLD_GLOBAL
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
    cpu_lib = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=mode)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    self.init = base.ggml_init
    self.init.argtypes, self.init.restype = [Ggml.InitParams], vp
    self.free = base.ggml_free
    self.free.argtypes, self.free.restype = [vp], None
    self.new_tensor_2d = base.ggml_new_tensor_2d
    self.new_tensor_2d.argtypes, self.new_tensor_2d.restype = [vp, ctypes.c_int, i64, i64], vp
    self.mul_mat = base.ggml_mul_mat
    self.mul_mat.argtypes, self.mul_mat.restype = [vp, vp, vp], vp
    self.new_graph = base.ggml_new_graph_custom
    self.new_graph.argtypes, self.new_graph.restype = [vp, ctypes.c_size_t, ctypes.c_bool], vp
    self.build_forward_expand = base.ggml_build_forward_expand
    self.build_forward_expand.argtypes, self.build_forward_expand.restype = [vp, vp], None
    self.get_data = base.ggml_get_data
    self.get_data.argtypes, self.get_data.restype = [vp], vp
    self.nbytes = base.ggml_nbytes
    self.nbytes.argtypes, self.nbytes.restype = [vp], ctypes.c_size_t
    self.graph_plan = cpu_lib.ggml_graph_plan
    self.graph_plan.argtypes, self.graph_plan.restype = [vp, ctypes.c_int, vp], Ggml.CPlan
    self.graph_compute = cpu_lib.ggml_graph_compute
    self.graph_compute.argtypes = [vp, ctypes.POINTER(Ggml.CPlan)]
    self.graph_compute.restype = ctypes.c_int
    self.cpu_init = getattr(cpu_lib, "ggml_cpu_init", None)
    if self.cpu_init is not None:
      self.cpu_init.argtypes, self.cpu_init.restype = [], None
      self.cpu_init()


class GgmlMatmuls:
  """Copies of one Q8_0 weight (N rows of K/32 blocks, ggml's `ne = [K, N]`) in a ggml context,
  float32 activations for each m, and one `mul_mat` graph per (copy, m), ready to compute."""

  def __init__(
    self, g: Ggml, blocks: list[np.ndarray], k: int, n: int, rows: tuple[int, ...], threads: int
  ):
    self.g, self.k, self.n, self.threads = g, k, n, threads
    weight_bytes = blocks[0].nbytes
    out_bytes = sum(4 * n * m for m in rows) * len(blocks)
    x_bytes = sum(4 * k * m for m in rows)
    size = (
      len(blocks) * weight_bytes + out_bytes + x_bytes + (len(blocks) * len(rows) + 16) * (1 << 16)
    )
    self.ctx = g.init(Ggml.InitParams(size, None, False))
    if not self.ctx:
      raise MemoryError("ggml_init failed")
    self.weights = []
    for b in blocks:
      t = g.new_tensor_2d(self.ctx, GGML_TYPE_Q8_0, k, n)
      assert g.nbytes(t) == b.nbytes, (g.nbytes(t), b.nbytes)
      ctypes.memmove(g.get_data(t), b.ctypes.data, b.nbytes)
      self.weights.append(t)
    self.x = {m: g.new_tensor_2d(self.ctx, GGML_TYPE_F32, k, m) for m in rows}
    self.graphs: dict[tuple[int, int], tuple[int, int, Ggml.CPlan]] = {}
    work = 0
    for i, w in enumerate(self.weights):
      for m in rows:
        y = g.mul_mat(self.ctx, w, self.x[m])
        graph = g.new_graph(self.ctx, 8, False)
        g.build_forward_expand(graph, y)
        plan = g.graph_plan(graph, threads, None)
        work = max(work, plan.work_size)
        self.graphs[i, m] = (graph, y, plan)
    self.work = np.zeros(max(work, 1) + 64, np.uint8)
    for _, _, plan in self.graphs.values():
      plan.work_data = self.work.ctypes.data

  def set_x(self, m: int, x: np.ndarray) -> None:
    """x: (m, K) float32 (ggml's ne = [K, m], the same bytes)."""
    x = np.ascontiguousarray(x, np.float32)
    ctypes.memmove(self.g.get_data(self.x[m]), x.ctypes.data, x.nbytes)

  def __call__(self, i: int, m: int) -> None:
    graph, _, plan = self.graphs[i, m]
    status = self.g.graph_compute(graph, ctypes.byref(plan))
    if status != 0:
      raise RuntimeError(f"ggml_graph_compute returned {status}")

  def result(self, i: int, m: int) -> np.ndarray:
    """The last product of copy i for m rows: (m, N) float32."""
    _, y, _ = self.graphs[i, m]
    buf = (ctypes.c_float * (m * self.n)).from_address(self.g.get_data(y))
    return np.frombuffer(buf, np.float32).reshape(m, self.n).copy()

  def close(self) -> None:
    if self.ctx:
      self.g.free(self.ctx)
      self.ctx = None


def ggml_blocks(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """Our q (K, N) int8 and scale (K/32, N) float16 as ggml Q8_0 blocks: (N, K/32) of 34 bytes."""
  k, n = q.shape
  out = np.empty((n, k // 32), BLOCK_Q8_0)
  out["d"] = scale.T
  out["qs"] = q.T.reshape(n, k // 32, 32)
  return out


def threads_given() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def run(shapes, rows, rounds: int, calls: int, threads: int, g: Ggml) -> tuple[list[dict], dict]:
  rotate = 2 * l3_bytes()
  rng = np.random.default_rng(0)
  jit_cpu = jax.jit(lambda x, w: q8rules.q8_matmul(x, w, implementation="cpu"))
  jit_xla = jax.jit(lambda x, w: q8rules.q8_matmul(x, w, implementation="xla"))
  jit_act = jax.jit(lambda x, w: q8rules.q8_matmul(x, w, implementation="cpu", act_qtype="q8_0"))
  lib = ctypes.CDLL(str(native_lib.loaded_path()))
  lib.Q8GemvIsaName.restype = ctypes.c_char_p

  # Per-call overheads: a tiny product on each side.
  q = rng.integers(-127, 128, (32, 16), dtype=np.int8)
  s = rng.uniform(1e-3, 1e-2, (1, 16)).astype(np.float16)
  tiny_w = q8rules.Q8Array(jnp.asarray(q), jnp.asarray(s), axis=0, dtype=jnp.float32)
  tiny_x = jnp.ones((1, 32), jnp.float32)
  tiny_g = GgmlMatmuls(g, [ggml_blocks(q, s)], 32, 16, (1,), threads)
  for _ in range(50):
    jax.block_until_ready(jit_cpu(tiny_x, tiny_w))
    tiny_g(0, 1)
  overhead = {  # ms, the least of 3 medians of 200 calls
    "q8 cpu": 1e3 * min(median_time(jit_cpu, tiny_x, tiny_w, warmup=0, reps=200) for _ in range(3)),
    "llama.cpp": 1e3 * min(median_time(tiny_g, 0, 1, warmup=0, reps=200) for _ in range(3)),
  }
  tiny_g.close()
  print(f"per-call overhead (K=32, N=16, m=1): {overhead}", flush=True)

  state = {}
  for k, n in shapes:
    q8_bytes = k * n * 34 // 32
    copies = max(2, -(-rotate // q8_bytes))
    ours, blocks = [], []
    for _ in range(copies):
      q = rng.integers(-127, 128, (k, n), dtype=np.int8)
      s = rng.uniform(0.5e-3, 2e-3, (k // 32, n)).astype(np.float16)
      ours.append(q8rules.Q8Array(jnp.asarray(q), jnp.asarray(s), axis=0, dtype=jnp.float32))
      blocks.append(ggml_blocks(q, s))
    gm = GgmlMatmuls(g, blocks, k, n, tuple(rows), threads)
    del blocks
    xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in rows}
    for m in rows:
      gm.set_x(m, xs[m])
    state[k, n] = dict(ours=ours, ggml=gm, x={m: jnp.asarray(xs[m]) for m in rows}, copies=copies)
    print(f"K={k} N={n}: {copies} copies of {q8_bytes / 2**20:.1f} MiB on each side", flush=True)

  paths = ("q8 cpu", "q8 xla", "q8 act", "llama.cpp")
  best = {}  # least per-round median
  least = {}  # fastest single call
  info = {}
  for r in range(rounds):
    for k, n in shapes:
      st = state[k, n]
      for m in rows:
        x, ours, gm, copies = st["x"][m], st["ours"], st["ggml"], st["copies"]
        fns = {  # call i: copy i
          "q8 cpu": lambda i, x=x, ours=ours: jit_cpu(x, ours[i]),
          "q8 xla": lambda i, x=x, ours=ours: jit_xla(x, ours[i]),
          "q8 act": lambda i, x=x, ours=ours: jit_act(x, ours[i]),
          "llama.cpp": lambda i, gm=gm, m=m: gm(i, m),
        }
        if r == 0:  # compile, check, and read every copy once
          for fn in fns.values():
            for i in range(copies):
              jax.block_until_ready(fn(i))
          y_cpu = np.asarray(jit_cpu(x, ours[0]), np.float64)
          gm(0, m)
          y_ggml = gm.result(0, m).astype(np.float64)
          isa = lib.Q8GemvIsaName(lib.Q8GemvLastIsa()).decode()
          y_act = np.asarray(jit_act(x, ours[0]), np.float64)
          info[k, n, m] = dict(
            isa=isa,
            act_path=native_simd.last_act_path(),
            diff=float(np.linalg.norm(y_ggml - y_cpu) / np.linalg.norm(y_cpu)),
            act_diff=float(np.linalg.norm(y_ggml - y_act) / np.linalg.norm(y_act)),
          )
        for path in paths:
          # Let the other side's spinning threads (XLA's pool, ggml's OpenMP team) go to sleep.
          time.sleep(0.02)
          times = call_times(fns[path], warmup=0, reps=max(calls, copies), rotate=range(copies))
          ms, fastest = 1e3 * float(np.median(times)), 1e3 * min(times)
          best[k, n, m, path] = min(best.get((k, n, m, path), float("inf")), ms)
          least[k, n, m, path] = min(least.get((k, n, m, path), float("inf")), fastest)
    print(f"round {r + 1}/{rounds} done", flush=True)
  for st in state.values():
    st["ggml"].close()

  records = []
  for k, n in shapes:
    for m in rows:
      t = {p: best[k, n, m, p] for p in paths}
      gb = (k * n * 34 // 32) / 1e9
      rec = dict(k=k, n=n, m=m, **{p: t[p] for p in paths}, **info[k, n, m])
      rec["ratio"] = t["q8 cpu"] / t["llama.cpp"]
      rec["act_ratio"] = t["q8 act"] / t["llama.cpp"]
      rec["min_cpu"] = least[k, n, m, "q8 cpu"]
      rec["min_ggml"] = least[k, n, m, "llama.cpp"]
      rec["min_ratio"] = rec["min_cpu"] / rec["min_ggml"]
      rec["gbs_cpu"] = gb / (t["q8 cpu"] * 1e-3)
      rec["gbs_ggml"] = gb / (t["llama.cpp"] * 1e-3)
      records.append(rec)
      print(
        f"K={k:5d} N={n:5d} m={m:2d}  q8 cpu ({rec['isa']}) {t['q8 cpu']:8.3f}  q8 xla"
        f" {t['q8 xla']:8.3f}  q8 act ({rec['act_path']}) {t['q8 act']:8.3f}  llama.cpp"
        f" {t['llama.cpp']:8.3f} ms  cpu/llama {rec['ratio']:.2f}  act/llama {rec['act_ratio']:.2f}"
        f"  |y_llama - y_cpu|/|y_cpu| {rec['diff']:.1e}  |y_llama - y_act|/|y_act|"
        f" {rec['act_diff']:.1e}",
        flush=True,
      )
  return records, overhead


def table(records: list[dict]) -> str:
  lines = [
    "| K | N | m | q8 cpu ms | q8 xla ms | llama.cpp ms | q8 cpu / llama.cpp | fastest call:"
    " q8 cpu / llama.cpp ms | ratio | q8 cpu GB/s | llama.cpp GB/s | ISA | rel diff of outputs |"
    " q8 act ms (Q8_0 activations) | q8 act / llama.cpp | act path | act's rel diff |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|",
  ]
  for r in records:
    lines.append(
      f"| {r['k']} | {r['n']} | {r['m']} | {r['q8 cpu']:.3f} | {r['q8 xla']:.3f}"
      f" | {r['llama.cpp']:.3f} | **{r['ratio']:.2f}** | {r['min_cpu']:.3f} / {r['min_ggml']:.3f}"
      f" | {r['min_ratio']:.2f} | {r['gbs_cpu']:.1f} | {r['gbs_ggml']:.1f} | {r['isa']}"
      f" | {r['diff']:.1e} | {r['q8 act']:.3f} | **{r['act_ratio']:.2f}** | {r['act_path']}"
      f" | {r['act_diff']:.1e} |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="K = N = 4096, m in {1, 8}")
  parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument(
    "--calls", type=int, default=10, help="timed calls per cell and round (at least one per copy)"
  )
  parser.add_argument(
    "--section",
    default="vs-llamacpp",
    help="RESULTS.md section to write (e.g. vs-llamacpp-1cpu for a run under taskset -c 0)",
  )
  parser.add_argument(
    "--threads",
    type=int,
    default=None,
    help="ggml threads (default: the CPUs this process may use)",
  )
  parser.add_argument(
    "--llama-cpp-site",
    default=None,
    help="a site-packages holding llama_cpp (e.g. /work/venv-llamacpp/lib/python3.11/site-packages)",
  )
  args = parser.parse_args()
  if args.llama_cpp_site:
    sys.path.append(args.llama_cpp_site)
  try:
    import llama_cpp
  except ImportError as e:
    print(
      f"bench_vs_llamacpp: skipped, llama_cpp does not import ({e}); install llama-cpp-python built for this CPU"
    )
    return
  if not native_lib.available():
    print(
      f"bench_vs_llamacpp: skipped, the native kernel is unavailable: {native_lib.unavailable_reason()}"
    )
    return
  build, missing = describe(**query(None))
  print(build, flush=True)
  if missing:
    print(f"bench_vs_llamacpp: {refusal(missing)}")
    return
  lib_dir = Path(llama_cpp.__file__).parent / "lib"
  g = Ggml(lib_dir)
  threads = args.threads or threads_given()
  shapes = QUICK_SHAPES if args.quick else SHAPES
  rows = (1, 8) if args.quick else ROWS
  rounds = args.rounds or (2 if args.quick else 3)
  now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  isa_lib = ctypes.CDLL(str(native_lib.loaded_path()))
  isa_lib.Q8GemvIsaName.restype = ctypes.c_char_p
  header = (
    f"Date: {now}. Machine: {machine()}; L3 {l3_bytes() >> 20} MiB; CPU flags: {cpu_flags()}."
    f" jax {jax.__version__}, jaxlib {jaxlib.__version__}, llama-cpp-python {llama_cpp.__version__},"
    f" numpy {np.__version__}. Threads: {threads} for ggml, {threads_given()} CPUs for XLA's pool"
    f" (affinity mask: CPUs {sorted(os.sched_getaffinity(0))})"
    f" (the q8 cpu kernel splits K over the pool and the calling thread)."
    f" Kernel ISA: best {isa_lib.Q8GemvIsaName(isa_lib.Q8GemvBestIsa()).decode()},"
    f" $Q8RULES_CPU_ISA={os.environ.get('Q8RULES_CPU_ISA', '(unset)')}."
    f" Load average at start: {load_average()}."
  )
  print(header, flush=True)
  records, overhead = run(shapes, rows, rounds, args.calls, threads, g)
  body = table(records)
  print()
  print(body)
  print(f"\nload average at the end: {load_average()}")
  if args.no_write:
    return
  command = " ".join(["python", "benchmarks/bench_vs_llamacpp.py", *sys.argv[1:]])
  text = results_md.section(
    args.section,
    f"{HEADING}, {threads} thread{'s' if threads > 1 else ''}",
    header + f" Load average at the end: {load_average()}. {build}",
    command,
    [
      f"Each time: the least of {rounds} per-round medians of >= {args.calls} calls, the three"
      " paths interleaved cell by cell (the 'fastest call' columns: the quickest single call of"
      " all rounds, less sensitive to other processes on a shared machine); calls rotate through weight copies totalling >= 2x the"
      " L3, so every call reads its weight from DRAM. GB/s: the Q8_0 weight bytes"
      " (K * N * 34/32) over the time. Times include each side's per-call overhead, measured on a"
      f" K = 32, N = 16, m = 1 product: q8 cpu (jax.jit dispatch + XLA FFI) {overhead['q8 cpu'] * 1e3:.0f} us,"
      f" llama.cpp (ctypes + ggml graph compute) {overhead['llama.cpp'] * 1e3:.0f} us."
      " llama.cpp is ggml's `mul_mat` (Q8_0 weight x float32 x, which ggml quantizes to Q8_0 inside"
      " the op: 8-bit activations, integer dot products), run by ggml's CPU backend through ctypes"
      " on the libggml inside llama_cpp. q8 cpu keeps x in float32 (the fold's numerics); the last"
      " column is |y_llama.cpp - y_q8cpu| / |y_q8cpu|, mostly llama.cpp's 8-bit activations.",
      body,
      "Model level (tokens/s, decode at batch 1 and 128-token prefill on one Q8_0 GGUF file):"
      " see the `gguf` section (`benchmarks/bench_gguf.py`).",
    ],
  )
  write_section(args.section, text)
  print("wrote benchmarks/RESULTS.md")


if __name__ == "__main__":
  main()
