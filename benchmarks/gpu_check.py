"""One prepared check of the fold kernel on a lent GPU: correctness first, then timings.

    bash benchmarks/gpu_check.sh                      # on the GPU machine (~2-4 min)
    python benchmarks/gpu_check.py --smoke            # anywhere: tiny shapes, interpret mode
    python benchmarks/gpu_check.py --out results.md   # where the table goes

1. Correctness: the GPU (Triton) fold against a float64 reference of the
   dequantised weight at a few shapes (float32 and bfloat16 rows, a padded N,
   K not a multiple of 256). Any failure aborts (exit 2) before timing.
2. HBM bandwidth: the median time of reading and writing a ~1 GiB array.
3. Timings (median of batches of back-to-back calls) of the fold, a bf16
   `jnp.dot`, Qwix's int8 weight with 32-row tiles (`qwix.quantize` +
   `qwix.dot`; skipped when Qwix does not import) and our chunked XLA path, at
   m in {1, 8, 16} rows and (K, N) in {4096^2, 8192^2, 8192 x 28672}: GB/s over
   the bytes each must move, and that as a fraction of the measured bandwidth.

Writes a markdown table to --out (default benchmarks/RESULTS_GPU.md). Runs with
jax 0.10 or 0.11 with CUDA; needs only jax and numpy (Qwix optional).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
FULL_SHAPES = [(4096, 4096), (8192, 8192), (8192, 28672)]
SMOKE_SHAPES = [(256, 256), (512, 384)]
ROWS = (1, 8, 16)
BLOCK_NS = (64, 32, 128)  # the fold's column tiles tried; 64 is its default
TOLERANCE = 1e-5  # relative Frobenius error against float64


def import_kernels() -> types.SimpleNamespace:
  """q8rules' fold and XLA path. The package's __init__ imports its Qwix/Flax
  providers; where those are missing, the kernels (jax and numpy only) load alone."""
  sys.path.insert(0, str(ROOT))
  try:
    importlib.import_module("q8rules")
  except ImportError as err:
    print(f"note: `import q8rules` failed ({err}); loading q8rules.kernels alone")
    for name in [n for n in sys.modules if n == "q8rules" or n.startswith("q8rules.")]:
      del sys.modules[name]
    package = types.ModuleType("q8rules")
    package.__path__ = [str(ROOT / "q8rules")]
    sys.modules["q8rules"] = package
  fold = importlib.import_module("q8rules.kernels.fold")
  xla = importlib.import_module("q8rules.kernels.xla_chunked")
  return types.SimpleNamespace(q8_fold=fold.q8_fold, q8_matmul_xla=xla.q8_matmul_xla)


def import_qwix():
  try:
    return importlib.import_module("qwix")
  except Exception as err:  # not installed, or a jax it does not support
    print(f"note: Qwix unavailable ({type(err).__name__}: {err}); its rows are skipped")
    return None


def operands(rng: np.random.Generator, m: int, k: int, n: int):
  """Fresh x (m, K) float32, q (K, N) int8 over [-127, 127], scale (K/32, N) float32 > 0."""
  x = rng.standard_normal((m, k), dtype=np.float32)
  q = rng.integers(-127, 128, (k, n), dtype=np.int8)
  scale = rng.uniform(0.5, 2.0, (k // BLOCK, n)).astype(np.float32) * np.float32(1e-2)
  return x, q, scale


def reference64(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  w = q.astype(np.float64) * np.repeat(scale.astype(np.float64), BLOCK, axis=0)
  return x.astype(np.float64) @ w


def rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check_correctness(kernels, smoke: bool) -> list[str]:
  """Rows of a table of fold errors; raises SystemExit(2) on any error over TOLERANCE."""
  rng = np.random.default_rng(20261130)
  cases = [(1, 4096, 4096), (16, 2048, 200), (8, 1056, 40), (5, 1024, 384)]
  if smoke:
    cases = [(1, 256, 128), (16, 288, 40)]
  rows, failures = [], []
  for m, k, n in cases:
    x, q, scale = operands(rng, m, k, n)
    for dtype in (jnp.float32, jnp.bfloat16):
      xd = jnp.asarray(x, dtype)
      out = kernels.q8_fold(xd, jnp.asarray(q), jnp.asarray(scale), backend="gpu")
      err = rel_err(out, reference64(np.asarray(xd.astype(jnp.float32)), q, scale))
      ok = err <= TOLERANCE
      rows.append(
        f"| {m} | {k} | {n} | {np.dtype(dtype).name} | {err:.2e} | {'ok' if ok else 'FAIL'} |"
      )
      print(f"correctness m={m} K={k} N={n} {np.dtype(dtype).name}: rel err {err:.2e}")
      if not ok:
        failures.append(rows[-1])
  if failures:
    raise CheckFailed(rows)
  return rows


class CheckFailed(Exception):
  """The fold disagreed with the float64 reference; carries the table rows."""


def median_seconds(fn: Callable[[], jax.Array], *, calls: int, batches: int) -> float:
  """Median over `batches` of (time of `calls` back-to-back calls) / calls, after warm-up."""
  jax.block_until_ready(fn())
  jax.block_until_ready(fn())
  times = []
  for _ in range(batches):
    start = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def hbm_bandwidth(nbytes: int, *, calls: int, batches: int) -> float:
  """Bytes/s of reading and writing an `nbytes` float32 array (a device copy with a +1)."""
  a = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  t = median_seconds(lambda: copy(a), calls=calls, batches=batches)
  return 2 * nbytes / t


def time_shapes(kernels, qwix, shapes, *, smoke: bool, bandwidth: float, deadline: float):
  """Table rows of median time, GB/s and fraction of bandwidth per (K, N, m, implementation)."""
  calls, batches = (2, 3) if smoke else (20, 7)
  rng = np.random.default_rng(7)
  rows = []
  fold = jax.jit(
    lambda x, q, s, block_n: kernels.q8_fold(x, q, s, backend="gpu", block_n=block_n),
    static_argnums=3,
  )
  xla = jax.jit(kernels.q8_matmul_xla)
  dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
  qdot = None
  if qwix is not None:
    qdot = jax.jit(lambda x, wq: qwix.dot(x, wq, preferred_element_type=jnp.float32))
  for k, n in shapes:
    _, q_np, s_np = operands(rng, 1, k, n)
    q, s = jnp.asarray(q_np), jnp.asarray(s_np)
    w = (q.astype(jnp.float32) * jnp.repeat(s, BLOCK, axis=0)).astype(jnp.bfloat16)
    wq = None
    if qwix is not None:
      wq = qwix.quantize(
        w, jnp.int8, channelwise_axes=(1,), tiled_axes={0: BLOCK}, scale_dtype=jnp.float32
      )
    q8_bytes = q.nbytes + s.nbytes
    for m in ROWS:
      if time.perf_counter() > deadline:
        rows.append(f"| {k} | {n} | {m} | (skipped: time budget) | | | | |")
        continue
      x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), jnp.bfloat16)
      io = x.nbytes + m * n * 4
      impls = [("bf16 jnp.dot", functools.partial(dense, x, w), w.nbytes + io)]
      for block_n in BLOCK_NS[:1] if smoke else BLOCK_NS:
        name = f"fold, {block_n} columns a program"
        impls.append((name, functools.partial(fold, x, q, s, block_n), q8_bytes + io))
      if wq is not None:
        wq_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(wq))
        impls.append(("Qwix int8 tile 32", functools.partial(qdot, x, wq), wq_bytes + io))
      impls.append(("q8rules XLA path", functools.partial(xla, x, q, s), q8_bytes + io))
      dense_t = None
      for name, fn, nbytes in impls:
        t = median_seconds(fn, calls=calls, batches=batches)
        if name.startswith("bf16"):
          dense_t = t
        gbs = nbytes / t / 1e9
        speed = f"{dense_t / t:.2f}x" if dense_t else ""
        rows.append(
          f"| {k} | {n} | {m} | {name} | {t * 1e6:.1f} | {nbytes / 1e6:.1f} | {gbs:.1f}"
          f" | {100 * nbytes / t / bandwidth:.0f}% | {speed} |"
        )
        print(rows[-1], flush=True)
  return rows


def suite_summary(log: Path) -> list[str]:
  """The test suite's result on this machine: pytest's closing line and each failure."""
  lines = log.read_text(errors="replace").splitlines() if log.exists() else []
  closing = [line for line in lines if " passed" in line or " failed" in line or "error" in line]
  failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
  out = ["## The test suite on this machine (`pytest -m 'not slow'`, notebooks aside)", ""]
  out.append(
    f"Result: `{closing[-1].strip('= ')}`" if closing else "Result: no closing line (timed out?)"
  )
  if failed:
    out += ["", *[f"- `{line}`" for line in failed]]
  return out


def write_report(path: Path, header: list[str], sections: list[list[str]]) -> None:
  text = "\n".join(header + [line for section in sections for line in ["", *section]]) + "\n"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS_GPU.md")
  parser.add_argument("--budget-s", type=float, default=100.0, help="stop timing after this")
  parser.add_argument("--suite-log", type=Path, help="pytest output to summarise (gpu_check.sh)")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  backend = jax.default_backend()
  if backend != "gpu" and not args.smoke:
    print(f"no GPU here (backend {backend!r}); run with --smoke to check the script on CPU")
    return 1
  kernels = import_kernels()
  qwix = import_qwix()
  device = jax.devices()[0]
  mode = "smoke, Pallas interpret mode" if backend != "gpu" else "Triton on device"
  header = [
    "# GPU check: the Q8_0 fold",
    "",
    f"- date: {datetime.date.today().isoformat()}; device: {device.device_kind} ({backend});"
    f" jax {jax.__version__}; {mode}",
    f"- command: `python benchmarks/gpu_check.py{' --smoke' if args.smoke else ''}`",
  ]
  correctness_head = [
    "## Correctness: fold vs float64 reference (relative Frobenius error)",
    "",
    "| m | K | N | x dtype | rel err | |",
    "|---|---|---|---|---|---|",
  ]
  try:
    correctness = check_correctness(kernels, args.smoke)
  except CheckFailed as failed:
    write_report(args.out, header, [correctness_head + failed.args[0], ["**ABORTED**"]])
    print("correctness FAILED: no timings taken")
    return 2
  nbytes = (16 << 20) if args.smoke else (1 << 30)
  bandwidth = hbm_bandwidth(nbytes, calls=2 if args.smoke else 10, batches=3 if args.smoke else 5)
  print(f"memory bandwidth (read+write of {nbytes >> 20} MiB): {bandwidth / 1e9:.0f} GB/s")
  timing_head = [
    "## Timings (median of batches of back-to-back calls; bf16 rows)",
    "",
    f"Measured bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write of a {nbytes >> 20} MiB"
    " array). Bytes: what each must move (weight parts, x, the f32 result).",
    "",
    "| K | N | m | implementation | µs | MB moved | GB/s | of bandwidth | vs bf16 dot |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
  timing = time_shapes(
    kernels,
    qwix,
    shapes,
    smoke=args.smoke,
    bandwidth=bandwidth,
    deadline=start + args.budget_s,
  )
  footer = [f"Total run: {time.perf_counter() - start:.0f} s."]
  sections = [correctness_head + correctness, timing_head + timing, footer]
  if args.suite_log is not None:
    sections.insert(0, suite_summary(args.suite_log))
  write_report(args.out, header, sections)
  return 0


if __name__ == "__main__":
  sys.exit(main())
