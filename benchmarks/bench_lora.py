"""LoRA training steps on a 135M decoder: a Q8_0 base (q8rules) against Qwix's own LoRA on a
float32 base and Qwix's QLoRA (int8 base, tile 32), one run, side by side.

    python benchmarks/bench_lora.py [--steps 5] [--rounds 1] [--write]

The model is q8rules' decoder (`q8rules.models.Transformer`, linen) at SmolLM2-135M's shape
(30 layers, dim 576, ffn 1536, 9 / 3 heads, vocab 49152, tied embeddings), unrolled (or with
`--scan` under the scan over layers, as `load_gguf` runs a model: one layer's program), float32
activations, run over the whole sequence from an empty KV cache (the cache a constant). Rank 16, alpha 32 adapters on every layer's q, k, v, o, gate, up and down; a step
is the next-token cross-entropy on a (4, 128) batch, its gradient in the adapters and an
optax.adam update, jitted with the adapters and Adam's state donated. Variants:

  q8_0 lora     `q8rules.Q8LoraProvider`: every matrix (the tied table too) stored as Q8_0,
                the adapted ones with their adapters
  f32 lora      `qwix.LoraProvider(...)`: the float32 base
  int8 qlora    `qwix.LoraProvider(..., weight_qtype='int8', tile_size=32)`: Qwix's QLoRA
                (the adapted matrices stored int8 with a scale per 32 rows; the table float32,
                as Qwix's rule leaves it)

Each variant runs in a fresh process. Memory: `runtime` is the process's RSS after importing
jax and running one op (the interpreter, jax and XLA, before any model); `peak` is the
process's high-water mark (VmHWM) over the timed steps, reset (`/proc/self/clear_refs` 5)
after the first, compiling, step and `malloc_trim` (which hands what compiling freed back to the
system; `settled` is the RSS then). The memory bound it checks is

    peak <= runtime + base + 2.5 x adapters (params + Adam's two moments + gradients) + activations

with `base` the bytes of every param that is not an adapter, and `activations` XLA's own count
of the step's temporary buffers (`compiled.memory_analysis().temp_size_in_bytes`). Speed:
tokens/s of the median timed step (4 x 128 tokens a step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

VARIANTS = ("q8_0 lora", "f32 lora", "int8 qlora")
TARGETS = r".*/(attn/(q|k|v|o)|mlp/(gate|up|down))"
"""The adapted products: every layer's attention q, k, v, o and MLP gate, up, down."""
RANK, ALPHA, BATCH, SEQ = 16, 32.0, 4, 128


def _status(field: str) -> int:
  """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
  with open("/proc/self/status") as f:
    line = next(line for line in f if line.startswith(field + ":"))
  return int(line.split()[1]) * 1024


def child(variant: str, steps: int, scan: bool = False) -> dict:
  """Build `variant`'s model, run `steps` + 1 training steps, return its measurements."""
  import ctypes
  import gc
  import hashlib
  import statistics
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import qwix

  import q8rules
  from q8rules.models import Transformer, TransformerConfig, init_cache

  jax.block_until_ready(jnp.ones(8) + 1)
  runtime = _status("VmRSS")
  config = TransformerConfig(
    arch="llama", vocab=49152, dim=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536,
    rope_base=100000.0, rope_style="halves", tied_embeddings=True, scan_layers=scan,
    dtype=jnp.float32,
  )  # fmt: skip
  lora = dict(module_path=TARGETS, rank=RANK, alpha=ALPHA)
  if variant == "q8_0 lora":
    provider = q8rules.Q8LoraProvider([q8rules.Q8LoraRule(**lora), q8rules.Q8Rule()])
  elif variant == "f32 lora":
    provider = qwix.LoraProvider(**lora)
  else:
    provider = qwix.LoraProvider(**lora, weight_qtype="int8", tile_size=32)
  model = qwix.quantize_model(Transformer(config), provider)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, config.vocab, (BATCH, SEQ + 1)), jnp.int32)
  cache = init_cache(config, SEQ, BATCH)
  params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1], cache)["params"]
  # B starts at zero: random B makes the step's numbers those of a trained adapter.
  params = jax.tree_util.tree_map_with_path(
    lambda p, v: v + 0.01 if jax.tree_util.keystr(p).endswith("_lora_b']") else v, params
  )

  def is_adapter(path) -> bool:
    return jax.tree_util.keystr(path).endswith(("_lora_a']", "_lora_b']"))

  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  adapters = {jax.tree_util.keystr(p): v for p, v in flat if is_adapter(p)}
  frozen = {jax.tree_util.keystr(p): v for p, v in flat if not is_adapter(p)}
  treedef = jax.tree_util.tree_structure(params)
  order = [jax.tree_util.keystr(p) for p, _ in flat]

  def loss_fn(adapters, frozen, tokens):
    both = {**adapters, **frozen}
    tree = jax.tree_util.tree_unflatten(treedef, [both[k] for k in order])
    logits, _ = model.apply({"params": tree}, tokens[:, :-1], cache)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(adapters)

  def step(adapters, opt_state, frozen, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(adapters, frozen, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, loss

  jax.clear_caches()  # init's executable
  gc.collect()
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc_trim(0)
  data = _status("VmRSS")
  jitted = jax.jit(step, donate_argnums=(0, 1))
  compiled = jitted.lower(adapters, opt_state, frozen, tokens).compile()
  libc.malloc_trim(0)
  program = _status("VmRSS") - data
  temp = compiled.memory_analysis().temp_size_in_bytes

  def digest(v) -> str:
    return hashlib.sha256(np.asarray(v).tobytes()).hexdigest()

  before = {k: digest(v) for k, v in frozen.items()}
  adapters, opt_state, first = compiled(adapters, opt_state, frozen, tokens)
  jax.block_until_ready(first)
  libc.malloc_trim(0)  # what compiling freed goes back to the system
  settled = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  times, losses = [], [float(first)]
  for _ in range(steps):
    t = time.perf_counter()
    adapters, opt_state, loss = compiled(adapters, opt_state, frozen, tokens)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t)
    losses.append(float(loss))
  peak = _status("VmHWM")
  unchanged = all(digest(v) == before[k] for k, v in frozen.items())

  def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))

  adapter = nbytes(adapters)
  return dict(
    variant=variant, scan=scan, runtime=runtime, base=nbytes(frozen), adapter=adapter,
    adapter_train=4 * adapter, activations=temp, data=data, program=program, settled=settled, peak=peak,
    bound=runtime + nbytes(frozen) + 2.5 * 4 * adapter + temp,
    step_s=statistics.median(times), tokens_s=BATCH * SEQ / statistics.median(times),
    losses=losses, base_unchanged=unchanged, n_adapters=len(adapters) // 2,
  )  # fmt: skip


DIM, FFN, LAYERS, VOCAB, KV_DIM = 576, 1536, 30, 49152, 192
PRODUCT_FLOPS = (
  4 * BATCH * SEQ * (LAYERS * (2 * DIM * DIM + 2 * DIM * KV_DIM + 3 * DIM * FFN) + DIM * VOCAB)
)
"""A step's dense products (every matrix and the tied head, forward and input gradient: 2 x 2
FLOPs a weight and token), the floor of any variant's step on float32 FMAs; the adapters, the
attention and the rest come on top."""


def gemm_rate() -> float:
  """XLA's float32 GEMM rate (FLOP/s, HIGHEST precision) at the step's shapes: the median
  over the shapes of each one's best of 10 calls."""
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  rates = []
  for k, n in ((DIM, FFN), (FFN, DIM), (DIM, VOCAB)):
    a = jnp.asarray(np.random.default_rng(0).random((BATCH * SEQ, k)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(1).random((k, n)), jnp.float32)
    f = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest"))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(10):
      t = time.perf_counter()
      f(a, b).block_until_ready()
      best = min(best, time.perf_counter() - t)
    rates.append(2 * BATCH * SEQ * k * n / best)
  return float(np.median(rates))


def run(variant: str, steps: int, scan: bool = False) -> dict:
  out = subprocess.run(
    [sys.executable, __file__, "--child", variant, "--steps", str(steps)]
    + (["--scan"] if scan else []),
    capture_output=True, text=True, cwd=ROOT,
  )  # fmt: skip
  if out.returncode:
    raise RuntimeError(f"{variant}: {out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def mb(n: float) -> str:
  return f"{n / 2**20:,.0f}"


def table(rows: list[dict], gemm: float) -> str:
  """The round's rows; `gemm`: XLA's float32 GEMM rate measured in the same round (FLOP/s)."""
  by = {r["variant"]: r for r in rows}
  q8 = by["q8_0 lora"]
  lines = [
    "| variant | adapters | base MB | adapter MB (x4: +Adam, grads) | activations MB | runtime MB"
    " | program MB | peak RSS MB | bound MB | peak - bound MB | step s | tokens/s |"
    " q8_0 speed ratio | products GFLOP/s (of the GEMM rate) | base bytes kept |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['variant']} | {r['n_adapters']} | {mb(r['base'])} | {mb(r['adapter'])}"
      f" ({mb(r['adapter_train'])}) | {mb(r['activations'])} | {mb(r['runtime'])}"
      f" | {mb(r['program'])} | {mb(r['peak'])} | {mb(r['bound'])} | {mb(r['peak'] - r['bound'])}"
      f" | {r['step_s']:.2f} | {r['tokens_s']:.0f} | {q8['tokens_s'] / r['tokens_s']:.2f}x"
      f" | {PRODUCT_FLOPS / r['step_s'] / 1e9:.0f} ({PRODUCT_FLOPS / r['step_s'] / gemm:.0%})"
      f" | {'yes' if r['base_unchanged'] else 'NO'} |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--child", choices=(*VARIANTS, "gemm"), help=argparse.SUPPRESS)
  parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
  parser.add_argument("--rounds", type=int, default=1, help="runs of all three, interleaved")
  parser.add_argument("--write", action="store_true", help="write RESULTS.md's section")
  parser.add_argument(
    "--scan", action="store_true", help="layers under the scan (one layer traced)"
  )
  args = parser.parse_args()
  if args.child == "gemm":
    print(json.dumps(dict(flops=gemm_rate())))
    return
  if args.child:
    print(json.dumps(child(args.child, args.steps, args.scan)))
    return
  rounds = []
  for i in range(args.rounds):
    rows = [run(v, args.steps, args.scan) for v in VARIANTS]
    gemm = run("gemm", 0)["flops"]
    rounds.append((rows, gemm))
    print(f"round {i + 1}, load {load_average()}\n{table(rows, gemm)}\n", flush=True)
  if args.write:
    header = (
      f"{datetime.date.today().isoformat()}, {machine()}; jax {__import__('jax').__version__},"
      f" qwix {__import__('importlib.metadata').metadata.version('qwix')}; load average"
      f" after the run {load_average()}"
    )
    blocks = [
      f"Round {i + 1} (XLA's float32 GEMM at the step's shapes: {gemm / 1e9:.0f} GFLOP/s):"
      f"\n\n{table(rows, gemm)}"
      for i, (rows, gemm) in enumerate(rounds)
    ]
    blocks.append(
      "Per variant a fresh process. bound = runtime + base + 2.5 x (adapters x 4) + activations"
      " (issue 32's memory bound; `runtime` is the process before any model, activations are"
      " XLA's temporary buffers of the step); `program` is what compiling the step added to the"
      " RSS (its code and XLA's own state, after `malloc_trim`), which the bound does not count."
      " q8_0 speed ratio: q8_0 lora's tokens/s over the row's. Losses fall over the steps in"
      " every variant (printed by the child, in the JSON). Products GFLOP/s: the step's dense"
      f" products ({PRODUCT_FLOPS / 1e9:.0f} GFLOP: every matrix and the tied head, forward"
      " and input gradient, float32 in every variant) over the step time, and that as a"
      " fraction of XLA's float32 GEMM rate at the step's shapes measured in the same round:"
      " the step's floor on this CPU's FMAs is those FLOPs at that rate."
    )
    scan = " --scan" if args.scan else ""
    cmd = (
      f"python benchmarks/bench_lora.py --steps {args.steps} --rounds {args.rounds}{scan} --write"
    )
    name = "lora-scan" if args.scan else "lora"
    heading = "## LoRA training steps: Q8_0 base vs Qwix's float32 LoRA and int8 QLoRA" + (
      ", layers under the scan" if args.scan else ""
    )
    write_section(name, section(name, heading, header, cmd, blocks))


if __name__ == "__main__":
  main()
