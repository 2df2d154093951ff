"""One prepared check of the Q8_0 products on a lent GPU: correctness first, then timings.

    bash benchmarks/gpu_check.sh                      # on the GPU machine (< 5 min)
    python benchmarks/gpu_check.py --smoke            # anywhere: tiny shapes, interpret mode
    python benchmarks/gpu_check.py --out results.md   # where the report goes

1. Correctness: every registered implementation that can run on this backend,
   called as users call it (`q8_matmul(x, w, implementation=name)`), and the
   Triton fold at several K splits, against a float64 reference (float32 and
   bf16 rows, a padded N, K not a multiple of 256). Implementations that round
   the weight to bf16 (`rounds_weight`) are held to 1e-2, the rest to 1e-5.
   Any failure aborts (exit 2) before timing.
2. HBM bandwidth: the median time of reading and writing a ~1 GiB array.
3. Timings, each section within its share of `--budget-s` (rows past it are
   written as skipped): decode (m in {1, 8, 16} at the issue's (K, N) shapes),
   prefill (m in {128, 512, 2048} at 4096 x 14336), a Llama-3-8B-shaped decoder
   (8 layers, bf16 params against Q8_0: a decode step at batch 1 and 8, a
   prefill of 512 tokens), then the fold's tuning variants (column tile, K
   splits, blocks a step, stages). Each row: time, bytes it must move, GB/s,
   share of the measured bandwidth, time relative to the bf16 dot, and Qwix
   int8's time over it. `implementation=None` rows name what `resolve` picked.

Writes markdown to --out (default benchmarks/RESULTS_GPU.md). Needs what
`import q8rules` needs (jax, numpy, Flax, Qwix: gpu_check.sh installs the wheels
gpu_wheels.sh fetched).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import qwix

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import q8rules  # noqa: E402
from q8rules import kernels  # noqa: E402
from q8rules.kernels.matmul import pallas_triton as triton  # noqa: E402
from q8rules.q8_0 import BLOCK, Q8Array, dequantize_blocks  # noqa: E402

DECODE_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 128256)]
DECODE_ROWS = (1, 8, 16)
PREFILL_SHAPE = (4096, 14336)
PREFILL_ROWS = (128, 512, 2048)
SMOKE_DECODE_SHAPES = [(256, 256), (512, 384)]
SMOKE_DECODE_ROWS = (1, 8)
SMOKE_PREFILL_SHAPE = (256, 128)
SMOKE_PREFILL_ROWS = (32,)
TOLERANCE = 1e-5  # relative Frobenius error against float64, exact products
ROUNDED_TOLERANCE = 1e-2  # the weight rounded to bf16 (`rounds_weight`)
SECTION_SHARES = {"decode": 0.45, "prefill": 0.15, "model": 0.25, "variants": 0.15}
"""Each timing section's share of --budget-s; unused time rolls over to the next."""
TIMING_HEAD = [
  "| K | N | m | path | µs | MB moved | GB/s | of bandwidth | time / bf16 dot | Qwix int8 / this |",
  "|---|---|---|---|---|---|---|---|---|---|",
]


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


class CheckFailed(Exception):
  """A product disagreed with the float64 reference; carries the table rows."""


def runnable(m: int, k: int, n: int, dtype) -> list[str]:
  """Registered implementations that can run the product on this backend (not the reference,
  which is a yardstick)."""
  names = [name for name in kernels.IMPLEMENTATIONS if name != "reference"]
  return [name for name in names if kernels.why_not(name, m, k, n, dtype) is None]


def check_correctness(smoke: bool) -> list[str]:
  """Table rows of errors against float64; raises CheckFailed on any over its tolerance."""
  rng = np.random.default_rng(20261130)
  cases = [(1, 4096, 4096), (16, 2048, 200), (5, 1056, 40), (128, 1056, 200)]
  if smoke:
    cases = [(1, 256, 128), (8, 288, 40), (32, 288, 40)]
  rows, failures = [], []

  def record(m, k, n, dtype, path, out, ref, tol):
    err = rel_err(out, ref)
    ok = err <= tol
    name = np.dtype(dtype).name
    rows.append(
      f"| {m} | {k} | {n} | {name} | {path} | {err:.2e} | {tol:.0e} | {'ok' if ok else 'FAIL'} |"
    )
    print(f"correctness m={m} K={k} N={n} {name} {path}: rel err {err:.2e}", flush=True)
    if not ok:
      failures.append(rows[-1])

  for m, k, n in cases:
    x, q, scale = operands(rng, m, k, n)
    w = Q8Array(q=jnp.asarray(q), scale=jnp.asarray(scale))
    for dtype in (jnp.float32, jnp.bfloat16):
      xd = jnp.asarray(x, dtype)
      ref = reference64(np.asarray(xd.astype(jnp.float32)), q, scale)
      for name in runnable(m, k, n, dtype):
        out = kernels.q8_matmul(xd, w, implementation=name, preferred_element_type=jnp.float32)
        rounds = kernels.REGISTRY[name].rounds_weight and dtype != jnp.float32
        record(m, k, n, dtype, name, out, ref, ROUNDED_TOLERANCE if rounds else TOLERANCE)
      if m <= triton.TILE_ROWS:  # the Triton form itself (interpreted off a GPU), any split
        blocks = k // BLOCK
        for splits in sorted({1, triton.k_splits(k, n), *(s for s in (2, 3) if blocks % s == 0)}):
          out = kernels.q8_fold(xd, w.q, w.scale, backend="gpu", splits=splits)
          record(m, k, n, dtype, f"Triton fold, {splits} K slices", out, ref, TOLERANCE)
  if failures:
    raise CheckFailed(rows)
  return rows


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


class Timer:
  """Times candidates of one product and writes a table row each (relative to the bf16 dot
  and to Qwix int8 tile 32 when those ran first)."""

  def __init__(self, bandwidth: float, smoke: bool):
    self.bandwidth = bandwidth
    self.calls, self.batches = (2, 3) if smoke else (20, 7)
    self.rows: list[str] = []

  def skipped(self, k, n, m, what: str, why: str) -> None:
    self.rows.append(f"| {k} | {n} | {m} | {what} (skipped: {why}) | | | | | | |")
    print(self.rows[-1], flush=True)

  def shape(self, k: int, n: int, m: int, candidates, deadline: float) -> None:
    """candidates: (path, fn, bytes moved) in order; the bf16 dot and Qwix tile 32 first."""
    dense_t = qwix_t = None
    for path, fn, nbytes in candidates:
      if time.perf_counter() > deadline:
        self.skipped(k, n, m, path, "time budget")
        continue
      try:
        t = median_seconds(fn, calls=self.calls, batches=self.batches)
      except Exception as err:  # a form that fails to compile or run here is a result too
        self.skipped(k, n, m, path, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
        continue
      if path.startswith("bf16"):
        dense_t = t
      if path.startswith("Qwix int8 tile 32"):
        qwix_t = t
      vs_dense = f"{t / dense_t:.2f}" if dense_t else ""
      vs_qwix = f"{qwix_t / t:.2f}x" if qwix_t else ""
      self.rows.append(
        f"| {k} | {n} | {m} | {path} | {t * 1e6:.1f} | {nbytes / 1e6:.1f} | {nbytes / t / 1e9:.1f}"
        f" | {100 * nbytes / t / self.bandwidth:.0f}% | {vs_dense} | {vs_qwix} |"
      )
      print(self.rows[-1], flush=True)


def product_candidates(k: int, n: int, m: int, rng, weights: dict, *, with_qwix: bool = True):
  """(path, fn, bytes) for one (m, K) x (K, N) bf16 product: the bf16 dot, Qwix int8 (tile 32,
  per channel), then every registered implementation that can run it, through `q8_matmul`."""
  if (k, n) not in weights:
    weights.clear()  # one shape's weights on the device at a time
    _, q_np, s_np = operands(rng, 1, k, n)
    q, s = jnp.asarray(q_np), jnp.asarray(s_np)
    w = dequantize_blocks(q, s, jnp.bfloat16)
    qws = {}
    if with_qwix:
      for label, tiled in (("tile 32", {0: BLOCK}), ("per channel", None)):
        qws[label] = qwix.quantize(
          w, jnp.int8, channelwise_axes=(1,), tiled_axes=tiled, scale_dtype=jnp.float32
        )
    weights[(k, n)] = (Q8Array(q=q, scale=s), w, qws)
  wq8, w, qws = weights[(k, n)]
  x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), jnp.bfloat16)
  io = x.nbytes + m * n * 2
  q8_bytes = wq8.q.nbytes + wq8.scale.nbytes + io
  dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
  out = [("bf16 jnp.dot", lambda: dense(x, w), w.nbytes + io)]
  for label, qw in qws.items():
    qdot = jax.jit(
      lambda x, qw: qwix.dot(x, qw, preferred_element_type=jnp.float32).astype(x.dtype)
    )
    nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(qw)) + io
    out.append((f"Qwix int8 {label}", lambda qdot=qdot, qw=qw: qdot(x, qw), nbytes))
  default = kernels.resolve_product(m, k, n, jnp.bfloat16)
  for name in runnable(m, k, n, jnp.bfloat16):
    f = jax.jit(lambda x, w, name=name: kernels.q8_matmul(x, w, implementation=name))
    path = f"{name} (implementation=None)" if name == default else name
    out.append((path, lambda f=f: f(x, wq8), q8_bytes))
  return out


def fold_variants(k: int, n: int, m: int, rng, weights: dict):
  """(path, fn, bytes) for the Triton fold's tuning knobs around its defaults (N a multiple of
  every column tile tried, so no padding is timed)."""
  wq8, _, _ = weights[(k, n)]  # product_candidates put it there
  tr = triton
  x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), jnp.bfloat16)
  nbytes = wq8.q.nbytes + wq8.scale.nbytes + x.nbytes + m * n * 4
  blocks = k // BLOCK
  auto = tr.k_splits(k, n)
  variants = [
    ("K slices 1 (grid over columns only)", dict(splits=1)),
    (f"K slices {2 * auto}", dict(splits=2 * auto)),
    ("64 -> 32 columns a program", dict(block_n=32)),
    ("64 -> 128 columns a program", dict(block_n=128)),
    ("8 blocks a step, 2 stages", dict(group=8, num_stages=2)),
    ("4 blocks a step, 3 stages", dict(num_stages=3)),
    ("8 warps", dict(num_warps=8)),
  ]
  out = []
  for label, kw in variants:
    tn = kw.get("block_n", tr.BLOCK_N)
    splits = kw.get("splits") or tr.k_splits(k, n, tn)
    group = kw.get("group")
    if n % tn or blocks % splits or (group and (blocks // splits) % group):
      continue
    kw = {**kw, "splits": splits, "interpret": jax.default_backend() != "gpu"}
    f = jax.jit(functools.partial(tr.fold_gpu, **kw))
    out.append((f"fold variant: {label}", lambda f=f: f(x, wq8.q, wq8.scale), nbytes))
  return out


def model_rows(timer: Timer, *, smoke: bool, deadline: float) -> list[str]:
  """A Llama-3-8B-shaped decoder (8 layers, dim 4096, ffn 14336, vocab 32000; smoke: tiny),
  bf16 activations, bf16 params against Q8_0 with `implementation=None`: a decode step at
  batch 1 and 8 and a prefill of 512 tokens; what each product ran, from the report."""
  from q8rules.models import (  # noqa: PLC0415  (an application)
    Transformer,
    TransformerConfig,
    init_cache,
  )

  q8r = q8rules
  dims = (
    dict(layers=1, dim=128, ffn=256, vocab=512)
    if smoke
    else dict(layers=8, dim=4096, ffn=14336, vocab=32000)
  )
  prefill = 16 if smoke else 512
  heads = dims["dim"] // 128
  config = TransformerConfig(
    **dims,
    heads=heads,
    kv_heads=max(1, heads // 4),  # Llama 3's grouped-query attention: 4 query heads a KV head
    head_dim=128,
    context_length=prefill + 8,
    dtype=jnp.bfloat16,
  )
  lines = [
    f"Transformer: {dims['layers']} layers, dim {dims['dim']}, ffn {dims['ffn']}, vocab"
    f" {dims['vocab']}, {config.heads} heads of 128 ({config.kv_heads} KV); bf16 activations;"
    " decode step at position"
    f" {prefill}; median of {timer.batches} x {timer.calls} calls.",
    "",
    "| batch | tokens | params | ms | tokens/s | Q8_0 time / bf16 time | products ran |",
    "|---|---|---|---|---|---|---|",
  ]
  model = Transformer(config)
  provider = q8r.Q8Provider([q8r.Q8Rule()])
  q8_model = qwix.quantize_model(model, provider)
  one = jnp.zeros((1, 1), jnp.int32)
  float_vars = jax.jit(model.init)(
    jax.random.key(0), one, init_cache(config, config.context_length), 0
  )
  abstract = jax.eval_shape(
    q8_model.init, jax.random.key(0), one, init_cache(config, config.context_length), 0
  )
  q8_vars = {"params": jax.jit(q8r.quantize_params)(float_vars["params"], abstract["params"])}
  float_step, q8_step = jax.jit(model.apply), jax.jit(q8_model.apply)
  for batch, tokens in ((1, 1), (8, 1), (1, prefill)):
    if time.perf_counter() > deadline:
      lines.append(f"| {batch} | {tokens} | (skipped: time budget) | | | | |")
      continue
    cache = init_cache(config, config.context_length, batch)
    prompt = jnp.zeros((batch, tokens), jnp.int32)
    pos = 0 if tokens > 1 else prefill
    reps = dict(calls=timer.calls, batches=timer.batches)
    t_f = median_seconds(functools.partial(float_step, float_vars, prompt, cache, pos), **reps)
    t_q = median_seconds(functools.partial(q8_step, q8_vars, prompt, cache, pos), **reps)
    counts: dict[str, int] = {}
    for path in provider.report().paths().values():  # the latest trace: this shape's
      counts[path] = counts.get(path, 0) + 1
    ran = ", ".join(f"{path} x{c}" for path, c in sorted(counts.items()))
    lines.append(
      f"| {batch} | {tokens} | bf16 | {t_f * 1e3:.3f} | {batch * tokens / t_f:.0f} | | XLA dot |"
    )
    lines.append(
      f"| {batch} | {tokens} | Q8_0 | {t_q * 1e3:.3f} | {batch * tokens / t_q:.0f}"
      f" | {t_q / t_f:.2f} | {ran} |"
    )
    print(*lines[-2:], sep="\n", flush=True)
  return lines


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
  parser.add_argument("--budget-s", type=float, default=150.0, help="time for all timings")
  parser.add_argument("--suite-log", type=Path, help="pytest output to summarise (gpu_check.sh)")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  backend = jax.default_backend()
  if backend != "gpu" and not args.smoke:
    print(f"no GPU here (backend {backend!r}); run with --smoke to check the script on CPU")
    return 1
  device = jax.devices()[0]
  mode = "smoke, Pallas interpret mode" if backend != "gpu" else "Triton on device"
  header = [
    "# GPU check: the Q8_0 products",
    "",
    f"- date: {datetime.date.today().isoformat()}; device: {device.device_kind} ({backend});"
    f" jax {jax.__version__}; {mode}",
    f"- command: `python benchmarks/gpu_check.py{' --smoke' if args.smoke else ''}`",
  ]
  correctness_head = [
    "## Correctness vs float64 (relative Frobenius error; x as stored)",
    "",
    "| m | K | N | x dtype | path | rel err | bound | |",
    "|---|---|---|---|---|---|---|---|",
  ]
  try:
    correctness = check_correctness(args.smoke)
  except CheckFailed as failed:
    write_report(args.out, header, [correctness_head + failed.args[0], ["**ABORTED**"]])
    print("correctness FAILED: no timings taken")
    return 2
  nbytes = (16 << 20) if args.smoke else (1 << 30)
  bandwidth = hbm_bandwidth(nbytes, calls=2 if args.smoke else 10, batches=3 if args.smoke else 5)
  print(f"memory bandwidth (read+write of {nbytes >> 20} MiB): {bandwidth / 1e9:.0f} GB/s")
  timing_start = time.perf_counter()
  deadlines, acc = {}, 0.0
  for section, share in SECTION_SHARES.items():
    acc += share
    deadlines[section] = timing_start + args.budget_s * acc
  rng = np.random.default_rng(7)
  weights: dict = {}
  shapes = SMOKE_DECODE_SHAPES if args.smoke else DECODE_SHAPES
  rows_m = SMOKE_DECODE_ROWS if args.smoke else DECODE_ROWS
  decode = Timer(bandwidth, args.smoke)
  for k, n in shapes:
    for m in rows_m:
      if time.perf_counter() > deadlines["decode"]:
        decode.skipped(k, n, m, "every path", "time budget")
        continue
      decode.shape(k, n, m, product_candidates(k, n, m, rng, weights), deadlines["decode"])
  prefill = Timer(bandwidth, args.smoke)
  k, n = SMOKE_PREFILL_SHAPE if args.smoke else PREFILL_SHAPE
  for m in SMOKE_PREFILL_ROWS if args.smoke else PREFILL_ROWS:
    if time.perf_counter() > deadlines["prefill"]:
      prefill.skipped(k, n, m, "every path", "time budget")
      continue
    prefill.shape(k, n, m, product_candidates(k, n, m, rng, weights), deadlines["prefill"])
  weights.clear()
  try:
    model = model_rows(Timer(bandwidth, args.smoke), smoke=args.smoke, deadline=deadlines["model"])
  except Exception as err:  # report it, keep the rest
    model = [f"Failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}"]
    print(model[0])
  variants = Timer(bandwidth, args.smoke)
  for k, n in shapes:
    m = 1
    if time.perf_counter() > deadlines["variants"]:
      variants.skipped(k, n, m, "fold variants", "time budget")
      continue
    cands = product_candidates(k, n, m, rng, weights, with_qwix=False)
    fold = [c for c in cands if c[0].startswith(("bf16", "fold"))]
    variants.shape(k, n, m, fold + fold_variants(k, n, m, rng, weights), deadlines["variants"])
  rows_head = (
    f"Measured bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write of a {nbytes >> 20} MiB"
    " array). Median of batches of back-to-back calls. Bytes: what each must move (weight"
    " parts, x, the bf16 result). `time / bf16 dot`: below 1 is faster than the bf16 weight;"
    " `Qwix int8 / this`: Qwix int8 (32-row tiles) time over this row's."
  )
  sections = [
    correctness_head + correctness,
    ["## Decode: bf16 rows", "", rows_head, "", *TIMING_HEAD, *decode.rows],
    ["## Prefill: bf16 rows", "", *TIMING_HEAD, *prefill.rows],
    ["## Model: a Llama-3-8B-shaped decoder, bf16 params against Q8_0", "", *model],
    ["## Fold tuning variants (m = 1; defaults first)", "", *TIMING_HEAD, *variants.rows],
    [f"Total run: {time.perf_counter() - start:.0f} s."],
  ]
  if args.suite_log is not None:
    sections.insert(0, suite_summary(args.suite_log))
  write_report(args.out, header, sections)
  return 0


if __name__ == "__main__":
  sys.exit(main())
