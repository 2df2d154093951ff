"""Tensor-parallel Q8_0 on forced host CPU devices: time and bytes per device vs device count.

A column-parallel product `x (1, K) @ W (K, N)`, K = N = 4096 (Llama-3-8B's q projection,
`benchmarks/shapes.py`), W Q8_0 split
along N over d = 1, 2, 4, 8 devices (`P(None, 'tp')`, x replicated), run by
`q8rules.sharding.q8_matmul_sharded` on the XLA path. Each d runs in its own
interpreter with `--xla_force_host_platform_device_count=d` (the count is fixed
when JAX starts). On a 2-core host the d "devices" share those 2 cores, so no
speedup is expected: what this shows is that each device holds and reads only
K x N/d int8 values and K/32 x N/d scales, and that the result matches the
one-device float64 reference.

    python benchmarks/bench_sharding.py            # writes the tp section of benchmarks/RESULTS.md
    python benchmarks/bench_sharding.py --no-write # print only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
sys.path.insert(0, str(ROOT))
from benchmarks import results_md  # noqa: E402
from benchmarks.results_md import load_average, machine, write_section  # noqa: E402
from benchmarks.shapes import LLAMA3_8B  # noqa: E402

HEADING = "## Tensor parallel (CPU)"
DEVICES = (1, 2, 4, 8)
K, N = LLAMA3_8B.shape("q")


def child(devices: int, calls: int) -> dict[str, Any]:
  """Run in a fresh interpreter with `devices` forced host devices; returns one row."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from q8rules import q8_matmul, quantize
  from q8rules.sharding import q8_matmul_sharded, shard_q8
  from q8rules.timing import median_time

  assert jax.device_count() == devices, jax.device_count()
  rng = np.random.default_rng(0)
  a = jax.jit(quantize)(rng.standard_normal((K, N)).astype(np.float32))
  mesh = jax.make_mesh((devices,), ("tp",))
  w = shard_q8(a, mesh, P(None, "tp"))
  x = jax.device_put(rng.standard_normal((1, K)).astype(np.float32), NamedSharding(mesh, P()))
  f = jax.jit(
    lambda x, w: q8_matmul_sharded(x, w, mesh, w_spec=P(None, "tp"), implementation="xla")
  )

  y = f(x, w)
  wf = np.asarray(a.q, np.float64) * np.repeat(np.asarray(a.scale, np.float64), 32, axis=0)
  ref = np.asarray(x, np.float64) @ wf
  err = float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))
  per_device: dict[int, int] = {}
  for arr in (w.q, w.scale):
    for s in arr.addressable_shards:
      per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
  row = {
    "devices": devices,
    "ms": 1e3 * median_time(f, x, w, warmup=3, reps=calls),
    "bytes_per_device": max(per_device.values()),
    "q_shard": list(w.q.addressable_shards[0].data.shape),
    "scale_shard": list(w.scale.addressable_shards[0].data.shape),
    "rel_err": err,
  }
  if devices == 1:
    plain = jax.jit(lambda x, a: q8_matmul(x, a, implementation="xla"))
    row["plain_ms"] = 1e3 * median_time(plain, jnp.asarray(x), a, warmup=3, reps=calls)
  return row


def run_child(devices: int, calls: int) -> dict[str, Any]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
    [sys.executable, __file__, "--child", str(devices), "--calls", str(calls)],
    env=env,
    capture_output=True,
    text=True,
    check=True,
    cwd=ROOT,
  ).stdout
  return json.loads(out.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| devices | q per device | scale per device | bytes per device | median ms | rel err vs float64 |",
    "|---:|---|---|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['devices']} | {tuple(r['q_shard'])} int8 | {tuple(r['scale_shard'])} f32"
      f" | {r['bytes_per_device']:,} | {r['ms']:.2f} | {r['rel_err']:.1e} |"
    )
  return "\n".join(lines)


def section(rows: list[dict[str, Any]], header: str, command: str) -> str:
  plain = rows[0].get("plain_ms")
  return results_md.section(
    "tp",
    HEADING,
    header,
    command,
    [
      f"Column-parallel `x (1, {K}) @ W ({K}, {N})`, W Q8_0 split along N (`P(None, 'tp')`),"
      " x replicated, `q8rules.sharding.q8_matmul_sharded` on the XLA path under `jax.jit`;"
      " each device count in its own process with that many forced host devices. Median of"
      " the timed calls, each waited for. The forced devices share the machine's cores, so"
      " time does not fall with more devices here; bytes per device do (int8 values plus"
      " float32 scales of the device's columns), and every count matches the float64"
      " reference."
      + (f" One device without `shard_map` (`q8_matmul`): {plain:.2f} ms." if plain else ""),
      table(rows),
    ],
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--calls", type=int, default=50, help="timed calls per device count")
  parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child is not None:
    print(json.dumps(child(args.child, args.calls)))
    return
  import jax

  now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  try:
    load = load_average()
  except OSError:
    load = "n/a"
  header = (
    f"Date: {now}. Machine: {machine()}. jax {jax.__version__}, backend cpu."
    f" Load average at start: {load}."
  )
  print(header, flush=True)
  rows = []
  for d in DEVICES:
    rows.append(run_child(d, args.calls))
    print(json.dumps(rows[-1]), flush=True)
  print(table(rows))
  if not args.no_write:
    command = "python benchmarks/bench_sharding.py" + (
      f" --calls {args.calls}" if args.calls != 50 else ""
    )
    write_section("tp", section(rows, header, command))
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
