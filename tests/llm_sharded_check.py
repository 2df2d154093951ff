"""`load_gguf(..., mesh=)` on 2 forced host CPU devices; run by tests/test_llm_gguf_mesh.py.

In a fresh interpreter (the device count is fixed when JAX starts):
`python tests/llm_sharded_check.py MODEL.gguf` prints 'ok' and the shard shapes, or fails.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from q8rules.checkpoint.assign import flatten  # noqa: E402
from q8rules.llm import load_gguf  # noqa: E402
from q8rules.q8_0 import Q8Array  # noqa: E402


def main(path: str) -> None:
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,))
  sharded = load_gguf(path, dtype=jnp.float32, mesh=mesh)
  flat = flatten(sharded.params)
  shards = {}
  layer = "layers" if sharded.config.scan_layers else "layers_0"  # stacked, or block 0
  for name in (f"{layer}.attn.q.kernel", f"{layer}.attn.o.kernel", f"{layer}.mlp.down.kernel"):
    a = flat[name]
    assert isinstance(a, Q8Array), name
    for part in (a.q, a.scale):
      local = {s.data.shape for s in part.addressable_shards}
      assert len(local) == 1 and len(part.addressable_shards) == 2, (name, local)
      assert part.sharding.shard_shape(part.shape) != part.shape, (name, "not split")
    shards[name] = a.q.sharding.shard_shape(a.q.shape)
  ids = [0, 41, 70, 77, 77, 80, 222, 88]
  want = load_gguf(path, dtype=jnp.float32).logits(ids)
  got = sharded.logits(ids)
  err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  assert err < 1e-5, err
  new = sharded.generate(ids, 4)
  assert new == load_gguf(path, dtype=jnp.float32).generate(ids, 4), new
  print("ok", shards, f"rel err {err:.1e}")


if __name__ == "__main__":
  main(sys.argv[1])
