"""A decode step of a Qwen3-30B-A3B-shaped MoE layer (128 experts, top 8, D 2048, F 768) on the
CPU: the grouped Q8_0 product (op 'ragged_matmul', its native kernel and its XLA path) against
the dense-dispatch einsum in float32 and bfloat16 and Qwix's int8 QT `ragged_dot`, in one run.

    python benchmarks/bench_ragged.py [--tokens 1,4] [--steps 16] [--threads 1,2] [--rounds 5]
                                      [--write]

A step: `tokens` tokens, each routed to 8 of the 128 experts (random, a fresh routing every step,
so the routed experts come from DRAM), the T * 8 rows sorted by expert; gate and up as one
grouped product (D -> 2F), SiLU(gate) * up, down (F -> D), each row weighted back into its
token. Each path runs `steps` steps in one jitted `lax.fori_loop` (the next step's x depends on
this one's output, so no Python dispatch is timed); a time is the best loop's mean step. The
Q8_0 paths run 3 loops in each of `--rounds` interleaved rounds (this VM's load and bandwidth
move within a minute), the baselines 3 loops once. The native kernel runs at each of `--threads`
(`q8rules.set_cpu_threads`); the XLA paths on XLA's own threads (every core). 'one weight' is
the native weight-only product on one (D, n 2F) and one (F, n D) weight a step, n the experts
routed: the same bytes in 2 products instead of 2n, the yardstick of the grouping.

Bytes: what the path must read a step. The Q8_0 paths: the routed experts only, each distinct
one's int8 values and float16 scales (K * N * 34 / 32 a matrix). The dense einsums: every
expert's float weights. Qwix's QT `ragged_dot` (`qwix.QtProvider` intercepting
`jax.lax.ragged_dot` in a Flax module, weight and activation int8: its weight-only form fails,
'Cannot use None as qtype') quantizes the float experts it is given on every call, as training
does, so it reads every expert's float32 weights (counted) and writes and reads their int8 (not
counted). GB/s: those bytes over the time; 'of read': that over `bandwidth.py`'s read bandwidth at
the same threads (the best of a probe before the paths and one after each round: this VM's
probe moves by up to 2x between runs).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bandwidth import read_bandwidth  # noqa: E402
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402

EXPERTS, TOP_K, D, F = 128, 8, 2048, 768
"""Qwen3-30B-A3B's MoE layer: 128 experts, 8 a token, hidden size 2048, expert FFN 768."""

WEIGHTS_PER_EXPERT = D * 2 * F + F * D
"""Values of one expert: gate and up (D, 2F), down (F, D)."""

PATHS = ("cpu", "one_weight", "xla", "dense_f32", "dense_bf16", "qwix_qt_int8")
"""'one_weight' is the yardstick of the grouping: the native weight-only product (op 'matmul')
on one (D, n 2F) and one (F, n D) weight a step, n the experts routed, so the same bytes in two
products instead of 2n (each step its own copy, up to `ROTATE_BYTES` of copies, from DRAM)."""

ROTATE_BYTES = 256 << 20


def routings(rng: np.random.Generator, steps: int, tokens: int) -> dict[str, np.ndarray]:
  """Per step (leading axis): `token` (T*8,) each row's token, rows sorted by expert; `weight`
  (T*8,) its combine weight; `sizes` (E,) rows per expert; `dense` (T, E) the combine weights
  as the dense dispatch takes them; `distinct` () the experts routed."""
  out: dict[str, list] = {"token": [], "weight": [], "sizes": [], "dense": [], "distinct": []}
  for _ in range(steps):
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
    w = rng.dirichlet(np.ones(TOP_K), size=tokens).astype(np.float32)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    out["token"].append((order // TOP_K).astype(np.int32))
    out["weight"].append(w.reshape(-1)[order])
    out["sizes"].append(np.bincount(flat, minlength=EXPERTS).astype(np.int32))
    dense = np.zeros((tokens, EXPERTS), np.float32)
    np.put_along_axis(dense, ids, w, axis=1)
    out["dense"].append(dense)
    out["distinct"].append(len(set(flat.tolist())))
  return {k: np.stack(v) for k, v in out.items()}


def experts(rng: np.random.Generator):
  """Random Q8_0 experts: (q, scale) of gate+up (E, D, 2F) and of down (E, F, D), float16
  scales."""
  q_gu = rng.integers(-127, 128, (EXPERTS, D, 2 * F), dtype=np.int8)
  s_gu = (rng.random((EXPERTS, D // 32, 2 * F)) / 64).astype(np.float16)
  q_dn = rng.integers(-127, 128, (EXPERTS, F, D), dtype=np.int8)
  s_dn = (rng.random((EXPERTS, F // 32, D)) / 64).astype(np.float16)
  return (q_gu, s_gu), (q_dn, s_dn)


def dequantized(q: np.ndarray, s: np.ndarray, dtype) -> np.ndarray:
  """q * scale as `dtype`, one expert at a time (no float64 temporaries)."""
  import jax.numpy as jnp

  out = np.empty(q.shape, np.dtype(jnp.dtype(dtype)))
  for e in range(q.shape[0]):
    out[e] = (q[e].astype(np.float32) * np.repeat(s[e].astype(np.float32), 32, axis=0)).astype(
      out.dtype
    )
  return out


def step_fns(path: str, gu, dn, q8):
  """(step(x, token, weight, sizes, dense, weights) -> (T, D) float32, weights) for `path`;
  `q8`: the experts as Q8Arrays (gate+up, down), shared by the Q8_0 paths."""
  import jax
  import jax.numpy as jnp

  from q8rules.kernels.ragged_matmul.api import q8_ragged_matmul

  def combine(y, token, weight, tokens):
    return jnp.zeros((tokens, D), jnp.float32).at[token].add(y * weight[:, None])

  if path in ("cpu", "xla"):

    def step(x, token, weight, sizes, dense, w):
      del dense
      h = q8_ragged_matmul(x[token], w[0], sizes, implementation=path)
      a = jax.nn.silu(h[:, :F]) * h[:, F:]
      y = q8_ragged_matmul(a, w[1], sizes, implementation=path)
      return combine(y, token, weight, x.shape[0])

    return step, q8
  if path.startswith("dense"):
    dtype = jnp.float32 if path == "dense_f32" else jnp.bfloat16
    w = (jnp.asarray(dequantized(*gu, dtype)), jnp.asarray(dequantized(*dn, dtype)))

    def step(x, token, weight, sizes, dense, w):
      del token, weight, sizes
      h = jnp.einsum("td,edf->tef", x.astype(dtype), w[0], preferred_element_type=jnp.float32)
      a = (jax.nn.silu(h[..., :F]) * h[..., F:]).astype(dtype)
      y = jnp.einsum("tef,efd->ted", a, w[1], preferred_element_type=jnp.float32)
      return jnp.einsum("ted,te->td", y, dense)

    return step, w
  if path == "qwix_qt_int8":
    import flax.linen as nn
    import qwix

    class MoE(nn.Module):
      @nn.compact
      def __call__(self, xs, sizes):
        gate_up = self.param("gate_up", nn.initializers.zeros, (EXPERTS, D, 2 * F))
        down = self.param("down", nn.initializers.zeros, (EXPERTS, F, D))
        h = jax.lax.ragged_dot(xs, gate_up, sizes)
        return jax.lax.ragged_dot(jax.nn.silu(h[:, :F]) * h[:, F:], down, sizes)

    rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")
    model = qwix.quantize_model(MoE(), qwix.QtProvider([rule]))
    params = {
      "params": {
        "gate_up": jnp.asarray(dequantized(*gu, jnp.float32)),
        "down": jnp.asarray(dequantized(*dn, jnp.float32)),
      }
    }

    def step(x, token, weight, sizes, dense, w):
      del dense
      y = model.apply(w, x[token], sizes)
      return combine(y, token, weight, x.shape[0])

    return step, params
  raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


def one_weight_fns(distinct: float, rng: np.random.Generator):
  """'one_weight' (see `PATHS`): step(x, ..., w) on copy `i` of the two wide weights, passed
  as the step's `token` argument, and the weights."""
  import jax
  import jax.numpy as jnp

  from q8rules.kernels.matmul.cpu import q8_matmul_cpu_layer

  n = round(distinct)
  copies = max(3, -(-ROTATE_BYTES // (n * WEIGHTS_PER_EXPERT)))
  parts = []
  for k, width in ((D, n * 2 * F), (F, n * D)):
    q = jnp.asarray(rng.integers(-127, 128, (copies, k, width), dtype=np.int8))
    scale = jnp.asarray((rng.random((copies, k // 32, width)) / 64).astype(np.float16))
    parts.append((q, scale))

  def step(x, copy, weight, sizes, dense, w):
    del weight, sizes, dense
    (q1, s1), (q2, s2) = w
    h = q8_matmul_cpu_layer(x[:1], q1, s1, copy)
    y = q8_matmul_cpu_layer(jax.nn.silu(h[:, :F]), q2, s2, copy)
    return jnp.zeros((x.shape[0], D), jnp.float32).at[0].add(y[0, :D])

  return step, tuple(parts), copies


def prepare(path: str, gu, dn, q8, route: dict[str, np.ndarray], x0, rng):
  """`once()`: seconds a step of one jitted loop of `path` over the routings (compiled and run
  once here)."""
  import jax
  import jax.numpy as jnp

  route = dict(route)
  if path == "one_weight":
    step, w, copies = one_weight_fns(float(route["distinct"].mean()), rng)
    route["token"] = np.arange(route["sizes"].shape[0], dtype=np.int32) % copies
  else:
    step, w = step_fns(path, gu, dn, q8)
  steps = route["sizes"].shape[0]
  arrays = tuple(jnp.asarray(route[k]) for k in ("token", "weight", "sizes", "dense"))

  @jax.jit
  def loop(x, arrays, w):
    def body(i, x):
      y = step(x, *(a[i] for a in arrays), w)
      return x + 1e-30 * y

    return jax.lax.fori_loop(0, steps, body, x)

  loop(x0, arrays, w).block_until_ready()

  def once() -> float:
    t = time.perf_counter()
    loop(x0, arrays, w).block_until_ready()
    return (time.perf_counter() - t) / steps

  return once


def bytes_read(path: str, distinct: float) -> float:
  """Bytes `path` must read a step (see the module's docstring)."""
  if path in ("cpu", "xla", "one_weight"):
    return (
      round(distinct) * WEIGHTS_PER_EXPERT * 34 / 32
      if path == "one_weight"
      else (distinct * WEIGHTS_PER_EXPERT * 34 / 32)
    )
  per_value = {"dense_f32": 4, "dense_bf16": 2, "qwix_qt_int8": 4}[path]
  return EXPERTS * WEIGHTS_PER_EXPERT * per_value


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default="1,4")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--threads", default="1,2", help="the native kernel's threads")
  ap.add_argument("--paths", default=",".join(PATHS))
  ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the Q8_0 paths")
  ap.add_argument("--write", action="store_true", help="write RESULTS.md's `ragged` section")
  ap.add_argument("--section", default="ragged", help="RESULTS.md section (e.g. ragged-avx2)")
  args = ap.parse_args()

  import jax.numpy as jnp

  import q8rules
  from q8rules.kernels.ragged_matmul.cpu import cannot as cpu_cannot
  from q8rules.kernels.ragged_matmul.problem import RaggedProblem

  threads = [int(t) for t in args.threads.split(",")]
  cores = max(threads)
  probe = {t: read_bandwidth(t, gib=2.0) for t in sorted({*threads, cores})}
  rng = np.random.default_rng(0)
  gu, dn = experts(rng)
  q8 = tuple(q8rules.Q8Array(jnp.asarray(q), jnp.asarray(s), axis=1) for q, s in (gu, dn))
  runs = []  # [tokens, label, threads, best seconds or None, bytes, note]
  rounds = []  # (run, threads, once): the Q8_0 paths, timed in interleaved rounds
  for tokens in (int(t) for t in args.tokens.split(",")):
    route = routings(rng, args.steps, tokens)
    distinct = float(route["distinct"].mean())
    x0 = jnp.asarray(rng.standard_normal((tokens, D)).astype(np.float32))
    for path in args.paths.split(","):
      native = path in ("cpu", "one_weight")
      note = {
        "cpu": f"{distinct:.1f} experts routed",
        "xla": f"{distinct:.1f} experts routed",
        "one_weight": "the routed bytes in 2 products, not 2 a routed expert",
      }.get(path, "every expert")
      for t in threads if native else [cores]:
        label = {"cpu": "q8 cpu", "one_weight": "q8 matmul cpu, one weight"}.get(path, path)
        label += f", {t} thread{'s' * (t > 1)}" if native else ""
        run = [tokens, label, t, None, bytes_read(path, distinct), note]
        runs.append(run)
        if path == "cpu":
          problem = RaggedProblem.of(tokens * TOP_K, D, 2 * F, EXPERTS, jnp.float32, "cpu")
          if (reason := cpu_cannot(problem)) is not None:
            run[5] = f"cannot run: {reason}"
            continue
        q8rules.set_cpu_threads(t if native else None)
        try:
          once = prepare(path, gu, dn, q8, route, x0, rng)
        except Exception as e:  # a path that cannot run here is reported, not fatal
          run[5] = f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
          continue
        finally:
          q8rules.set_cpu_threads(None)
        if path in ("cpu", "one_weight", "xla"):
          rounds.append((run, t if native else None, once))
        else:  # the baselines (every expert, 100x slower): 3 loops now, then freed
          run[3] = min(once() for _ in range(3))
        print(run, flush=True)
  for _ in range(args.rounds):  # interleaved: this VM's load moves within a minute
    for run, t, once in rounds:
      q8rules.set_cpu_threads(t)
      run[3] = min(run[3] or float("inf"), *(once() for _ in range(3)))
    q8rules.set_cpu_threads(None)
    for t in probe:
      probe[t] = max(probe[t], read_bandwidth(t, gib=2.0))
  lines = [
    "| tokens | path | ms a step | MB read a step | GB/s | of read | note |",
    "|---:|---|---:|---:|---:|---:|---|",
  ]
  for tokens, label, t, seconds, nbytes, note in runs:
    if seconds is None:
      lines.append(f"| {tokens} | {label} | n/a | | | | {note} |")
      continue
    gbs = nbytes / seconds / 1e9
    lines.append(
      f"| {tokens} | {label} | {seconds * 1e3:.2f} | {nbytes / 1e6:.1f} | {gbs:.1f} |"
      f" {gbs / probe[t]:.0%} | {note} |"
    )
  probe_text = ", ".join(f"{t} thread{'s' * (t > 1)} {g:.1f} GB/s" for t, g in probe.items())
  table = "\n".join(lines)
  print(f"read bandwidth: {probe_text}\n{table}")
  if args.write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
      f"{when}. Machine: {machine()}. Load average at the end: {load_average()}. Read"
      f" bandwidth (`benchmarks/bandwidth.py`, 2 GiB, best of the probes before and between the"
      f" rounds): {probe_text}."
    )
    heading = "## Grouped Q8_0 product: a Qwen3-30B-A3B-shaped MoE decode step (CPU)"
    cmd = "python benchmarks/bench_ragged.py " + " ".join(sys.argv[1:])
    write_section(args.section, section(args.section, heading, header, cmd, [table]))


if __name__ == "__main__":
  main()
