"""One process of a run over several (tests/test_multiprocess.py starts them).

    python -m tests.multiproc_worker PORT PROCESS_ID NUM_PROCESSES GGUF OUT_DIR [SCENARIO ...]

Each process gets 2 CPU devices, joins `jax.distributed` on localhost:PORT (CPU collectives
by gloo), then for each scenario loads GGUF onto a mesh over all processes' devices and
writes OUT_DIR/<scenario>-<process>.npz: the logits of `IDS`, the greedy tokens, the bytes
this process read from the file, its resident memory before, at the peak of and after the
load, and its peak over the whole run. Scenarios:

  tp      mesh ('tp',) over every device
  dp_tp   mesh ('dp', 'tp') = (processes, devices per process): each process one replica
  tp_dp   mesh ('dp', 'tp') = (devices per process, processes): tp across the processes
  die=N   process N exits at once; the others load and run, which must fail, not hang
  error=P load the GGUF file P on the mesh ('tp',) over every device, which cannot split it:
          OUT_DIR/error-<process>.txt holds the error's message
  split=P the same as tp, from the split GGUF set whose first part is P
  rules   the Flax rules path: `rules_forward` (a linen MLP served by `Q8Provider`, its params
          placed by `shard_params` and its products run per shard by `shard_products`) on
          an Explicit mesh ('tp',) over every device and an Auto one ('dp', 'tp') with tp across
          the processes: OUT_DIR/rules-<process>.npz holds both outputs

A line `READY <process>` on stdout follows `jax.distributed.initialize`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

IDS = [0, 41, 70, 77, 77, 80, 222, 88]
NEW_TOKENS = 4
LOCAL_DEVICES = 2


def rss_mib(field: str = "VmRSS") -> float:
  """A /proc/self/status memory field in MiB (VmRSS: resident now; VmHWM: peak since start or
  since `reset_peak_rss`); NaN where there is no /proc."""
  try:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")


def reset_peak_rss() -> None:
  """Start VmHWM afresh (Linux: `echo 5 > /proc/self/clear_refs`), to measure one step's peak."""
  try:
    Path("/proc/self/clear_refs").write_text("5")
  except OSError:
    pass


RULES_SPECS = {"up/kernel": ("_", "tp"), "down/kernel": ("tp", "_")}
"""Column-parallel up, row-parallel down ('_': not split)."""


def rules_forward(mesh: Any) -> Any:
  """The Flax rules path on `mesh`: a linen MLP (64 -> 256 -> 64, relu) quantized by
  `qwix.quantize_model(..., Q8Provider([Q8Rule()]))`, params from `jax.random.key(0)` (the
  same in every process), placed by `q8rules.sharding.shard_params` and run under
  `q8rules.shard_products`. Returns the (6, 64) float32 output, replicated."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import qwix
  from jax.sharding import PartitionSpec as P

  import q8rules
  from q8rules import sharding

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(64, use_bias=False, name="down")(
        jax.nn.relu(nn.Dense(256, use_bias=False, name="up")(x))
      )

  x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 64)), jnp.float32)
  qmodel = qwix.quantize_model(Mlp(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  params = jax.jit(qmodel.init)(jax.random.key(0), x)["params"]
  specs = {k: P(*(None if a == "_" else a for a in v)) for k, v in RULES_SPECS.items()}
  placed = sharding.shard_params(params, mesh, specs)
  with q8rules.shard_products(mesh, specs):
    y = jax.jit(qmodel.apply)({"params": placed}, x)
  return np.asarray(y)


def main(argv: list[str]) -> None:
  port, pid, nproc, path, out = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
  scenarios = argv[5:]
  import jax

  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}",
    num_processes=nproc,
    process_id=pid,
    initialization_timeout=60,
    heartbeat_timeout_seconds=20,
    shutdown_timeout_seconds=30,
  )
  print(f"READY {pid}", flush=True)
  import jax.numpy as jnp
  import numpy as np

  from q8rules.checkpoint import CheckpointError
  from q8rules.llm import load_gguf

  assert jax.process_count() == nproc and jax.local_device_count() == LOCAL_DEVICES
  devices = np.array(jax.devices())  # process 0's devices first
  for scenario in scenarios:
    if scenario == "tp" or scenario.startswith("split="):
      mesh = jax.make_mesh((devices.size,), ("tp",), devices=list(devices))
    elif scenario == "dp_tp":  # each process holds one whole replica
      mesh = jax.sharding.Mesh(devices.reshape(nproc, LOCAL_DEVICES), ("dp", "tp"))
    elif scenario == "tp_dp":  # tp across the processes, dp within each
      mesh = jax.sharding.Mesh(devices.reshape(nproc, LOCAL_DEVICES).T, ("dp", "tp"))
    elif scenario.startswith("die="):  # process N exits; the others go on into collectives
      if pid == int(scenario.removeprefix("die=")):
        print(f"DYING {pid}", flush=True)
        os._exit(3)
      mesh = jax.make_mesh((devices.size,), ("tp",), devices=list(devices))
      m = load_gguf(path, dtype=jnp.float32, mesh=mesh)
      for _ in range(1000):  # a collective per step: fails once the peer is gone
        m.logits(IDS)
      raise SystemExit(f"process {pid}: ran on while process {scenario} was gone")
    elif scenario == "rules":
      tp = jax.make_mesh((devices.size,), ("tp",), devices=list(devices))
      dp_tp = jax.sharding.Mesh(devices.reshape(nproc, LOCAL_DEVICES).T, ("dp", "tp"))
      np.savez(out / f"rules-{pid}.npz", tp=rules_forward(tp), tp_dp=rules_forward(dp_tp))
      continue
    elif scenario.startswith("error="):
      mesh = jax.make_mesh((devices.size,), ("tp",), devices=list(devices))
      try:
        load_gguf(scenario.removeprefix("error="), dtype=jnp.float32, mesh=mesh)
      except CheckpointError as e:
        (out / f"error-{pid}.txt").write_text(str(e))
        continue
      raise SystemExit(f"process {pid}: the load on {mesh.shape} did not fail")
    else:
      raise SystemExit(f"unknown scenario {scenario!r}")
    rss0, peak_before = rss_mib(), rss_mib("VmHWM")
    reset_peak_rss()
    t0 = time.perf_counter()
    m = load_gguf(scenario.partition("split=")[2] or path, dtype=jnp.float32, mesh=mesh)
    load_s = time.perf_counter() - t0
    rss_load, rss_after = rss_mib("VmHWM"), rss_mib()
    logits = m.logits(IDS)
    tokens = m.generate(IDS, NEW_TOKENS)
    np.savez(
      out / f"{scenario.partition('=')[0]}-{pid}.npz",
      logits=logits,
      tokens=np.asarray(tokens),
      bytes_read=m.bytes_read,
      peak_rss_mib=max(peak_before, rss_mib("VmHWM")),  # not ru_maxrss: exec keeps the parent's
      rss_before_load_mib=rss0,
      peak_rss_at_load_mib=rss_load,
      rss_after_load_mib=rss_after,
      load_s=load_s,
      mesh=json.dumps({k: int(v) for k, v in mesh.shape.items()}),
    )
    print(f"DONE {scenario} {pid} bytes_read={m.bytes_read}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
