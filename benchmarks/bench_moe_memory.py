"""Peak memory of a served MoE model against its Q8_0 bytes: Tunix's Qwen 3 MoE (experts as `w[i]`
slices in a loop of einsums, its CPU path) and Gemma 4 MoE (experts through `jax.lax.ragged_dot`),
served by `q8rules.Q8Provider`, each run in a fresh process.

    python benchmarks/bench_moe_memory.py [--layers 2] [--experts 32] [--dim 1024] [--ffn 768]
                                          [--tokens 16] [--write]

A run (one per model and form, each its own process):

  1. the served model's abstract state, never a float copy of it: the Tunix model built and
     quantized under `nnx.eval_shape` with `Q8Provider.shapes_only()`;
  2. the forward (`tokens` tokens of a prefill, then one token; Gemma 4's sliding-window layers
     take one token only with a cache, so its prefill alone) compiled ahead of time from that
     state's shapes, so the compiler's own memory is spent before the baseline;
  3. the baseline: the process's resident set (`VmRSS`), then its peak reset
     (`/proc/self/clear_refs`);
  4. the params made leaf by leaf on the device, each by a compiled fused fill (a pattern of
     int8 values, small float scales, norms and routers; no host copy, no temporary), and the
     compiled forward run on them;
  5. the peak: `VmHWM` less the baseline, against the Q8_0 bytes (every param's bytes: int8
     values, scales and what stays float) and XLA's own count of the forward's temporaries
     (`memory_analysis().temp_size_in_bytes`, the activations).

The target: peak <= 1.15 x the params' bytes + the activations. 'float32' is the same model
with float32 weights (what the Q8_0 model replaces), measured the same way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

FORMS = ("qwen3-moe q8_0", "gemma4-moe q8_0", "qwen3-moe float32")
"""(model, weights) of each run."""

TARGET = 1.15


def status_kib(field: str) -> int:
  """A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`)."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
  """`VmHWM` back to the current resident set."""
  Path("/proc/self/clear_refs").write_text("5")


def build(model_name: str, args: argparse.Namespace, dtype: str) -> Any:
  """The Tunix model (float params of `dtype`), not yet initialised: a function to call under
  `nnx.eval_shape`."""
  import jax.numpy as jnp
  from flax import nnx

  common = dict(num_heads=8, head_dim=128, num_kv_heads=4, param_dtype=jnp.dtype(dtype))
  if model_name == "qwen3-moe":
    from tunix.models.qwen3 import model as q3

    cfg = q3.ModelConfig(
      num_layers=args.layers,
      vocab_size=args.vocab,
      embed_dim=args.dim,
      hidden_dim=args.ffn,
      rope_theta=10_000,
      norm_eps=1e-6,
      num_experts=args.experts,
      num_experts_per_tok=8,
      dtype=jnp.float32,
      **common,
    )
    return lambda: q3.Qwen3(cfg, rngs=nnx.Rngs(0))
  from tunix.models.gemma4 import model as g4

  cfg = g4.ModelConfig(
    num_layers=args.layers,
    num_embed=args.vocab,
    embed_dim=args.dim,
    hidden_dim=args.ffn,
    sliding_window_size=64,
    global_key_size=128,
    attention_pattern=(g4.AttentionType.LOCAL_SLIDING, g4.AttentionType.GLOBAL),
    enable_moe=True,
    num_experts=args.experts,
    expert_dim=args.ffn,
    num_experts_per_tok=8,
    moe_dense_hidden_dim=args.ffn,
    dtype=jnp.float32,
    **common,
  )
  return lambda: g4.Gemma4(cfg, rngs=nnx.Rngs(0))


def inputs(args: argparse.Namespace, length: int) -> tuple[Any, ...]:
  """(tokens (1, length), positions, no cache, causal mask)."""
  import jax.numpy as jnp

  tokens = jnp.arange(length, dtype=jnp.int32)[None] % args.vocab
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  mask = jnp.tril(jnp.ones((length, length), bool))[None]
  return tokens, positions, None, mask


def leaf_maker(shape: tuple[int, ...], dtype: Any) -> Any:
  """A compiled function making a leaf of `shape` and `dtype` on the device in one fused pass
  (nothing but the leaf allocated): int8 values in [-127, 127], floats (scales, norms, routers)
  about 0.01, a pattern of the element's index (the served memory does not depend on values)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  def make() -> jax.Array:
    flat = sum(
      jax.lax.broadcasted_iota(jnp.int32, shape, d) * (7 + 13 * d) for d in range(len(shape))
    )
    if np.dtype(dtype) == np.int8:
      return (flat % 255 - 127).astype(jnp.int8)
    return ((flat % 17).astype(jnp.float32) * 1e-3 + 1e-3).astype(dtype)

  return jax.jit(make).lower().compile()


def child(form: str, args: argparse.Namespace) -> dict[str, Any]:
  """One run of `form` in this process (see the module)."""
  import jax
  import numpy as np
  import qwix
  from flax import nnx

  import q8rules

  model_name, weights = form.split()
  make = build(model_name, args, "float32")
  # Gemma 4's sliding-window layers take one token only with a cache: its prefill alone
  lengths = {"prefill": args.tokens} | ({"decode": 1} if model_name == "qwen3-moe" else {})
  xs = {name: inputs(args, n) for name, n in lengths.items()}
  provider = q8rules.Q8Provider([q8rules.Q8Rule()])
  if weights == "q8_0":

    def quantized() -> Any:
      with provider.shapes_only():
        return qwix.quantize_model(make(), provider, *xs["prefill"])

    abstract = nnx.eval_shape(quantized)
  else:
    abstract = nnx.eval_shape(make)
  graphdef, state = nnx.split(abstract)

  def forward(state: Any, x: tuple[Any, ...]) -> Any:
    return nnx.merge(graphdef, state)(*x)[0]

  compiled = {n: jax.jit(forward).lower(state, x).compile() for n, x in xs.items()}
  activations = max(c.memory_analysis().temp_size_in_bytes for c in compiled.values())
  leaves, treedef = jax.tree.flatten(state)
  makers = {(leaf.shape, np.dtype(leaf.dtype)): None for leaf in leaves}
  makers = {key: leaf_maker(*key) for key in makers}
  baseline = status_kib("VmRSS")
  reset_peak()
  values = [makers[(leaf.shape, np.dtype(leaf.dtype))]() for leaf in leaves]
  param_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in values)
  jax.block_until_ready(values)
  state = jax.tree.unflatten(treedef, values)
  after_params = status_kib("VmRSS") - baseline
  for name, x in xs.items():
    out = compiled[name](state, x)
    assert bool(np.isfinite(np.asarray(out)).all()), name
  peak = status_kib("VmHWM") - baseline
  return {
    "form": form,
    "steps": "+".join(f"{n} {t}" for n, t in lengths.items()),
    "param_bytes": param_bytes,
    "after_params": after_params * 1024,
    "peak": peak * 1024,
    "activations": int(activations),
  }


def run(form: str, args: argparse.Namespace) -> dict[str, Any]:
  """`child(form)` in a fresh process."""
  argv = [sys.executable, __file__, "--child", form, *sys.argv[1:]]
  out = subprocess.run(argv, capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"{form}: {out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
  """The results as a Markdown table (MiB)."""
  mib = 1 << 20
  lines = [
    "| model | weights | tokens a step | params | resident after params | peak"
    " | activations (XLA temps) | peak / params | target (1.15 x params + activations) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    model, weights = r["form"].split()
    limit = TARGET * r["param_bytes"] + r["activations"]
    verdict = "met" if r["peak"] <= limit else "exceeded"
    lines.append(
      f"| {model} | {weights} | {r['steps']} | {r['param_bytes'] / mib:.1f} MiB | {r['after_params'] / mib:.1f}"
      f" MiB | {r['peak'] / mib:.1f} MiB | {r['activations'] / mib:.1f} MiB"
      f" | {r['peak'] / r['param_bytes']:.3f} | {limit / mib:.1f} MiB: {verdict} |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--experts", type=int, default=32)
  parser.add_argument("--dim", type=int, default=1024)
  parser.add_argument("--ffn", type=int, default=768)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=16)
  parser.add_argument("--forms", default=",".join(FORMS))
  parser.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child, args)))
    return
  rows = [run(form, args) for form in args.forms.split(",")]
  text = table(rows)
  print(text)
  if args.write:
    import jax

    header = (
      f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
      f"- machine: {machine()}; jax {jax.__version__} on cpu; load average at the end:"
      f" {load_average()}"
    )
    shape = (
      f"{args.layers} layers, {args.experts} experts (top 8), D {args.dim}, F {args.ffn}, vocab"
      f" {args.vocab}, 8 heads of 128 (4 KV); float32 activations; a {args.tokens}-token prefill"
      " and a one-token step, each compiled ahead of time"
    )
    command = "python benchmarks/bench_moe_memory.py" + "".join(
      f" {a}" for a in sys.argv[1:] if a != "--write"
    )
    heading = "## Peak memory of a served MoE model"
    write_section("moe-memory", section("moe-memory", heading, header, command, [shape, text]))


if __name__ == "__main__":
  main()
