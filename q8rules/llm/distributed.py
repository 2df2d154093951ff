"""A loaded model on a device mesh, one process or several: what `GGUFModel` and `load_gguf`
need beyond the decoder.

    mesh = jax.make_mesh((2,), ("tp",))          # Explicit axes (this jax's default) or Auto
    m = q8rules.load_gguf(path, mesh=mesh)       # every process runs the same calls

* `check_mesh`: before anything is read, the mesh must split the model as Megatron does: the
  'tp' axis divides the query and the key/value heads (a head is never cut), and a row-
  parallel Q8_0 weight's K rows split into whole 32-row blocks per device. The errors name
  the file's tensor and are raised alike on every process (they depend on the metadata and
  the mesh's shape only), before any collective.
* `init_cache_on`: the KV cache (layers, batch, length, kv_heads, head_dim) split along
  kv_heads over 'tp', as the k / v projections' outputs are: with Explicit mesh axes the
  cache update needs the two to agree (an unsplit cache against a split update is JAX's
  `ShardingTypeError`), and a split cache holds 1/tp of the keys per device anyway.
* `on_mesh`: host values (token ids, the position) as arrays replicated over the mesh: in a
  run over several processes a jitted function takes only global arrays.
* `to_host`: a result as numpy on every process (replicated results are read from a local
  shard; split ones are gathered across processes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules.checkpoint import CheckpointError
from q8rules.models.transformer import TransformerConfig, init_cache
from q8rules.q8_0 import BLOCK

TP = "tp"
"""The mesh axis tensor parallelism splits along (`q8rules.llm.model.TP_SPECS`)."""


def tp_size(mesh: Mesh | None) -> int:
  """Devices along the mesh's 'tp' axis (1 without a mesh or without the axis)."""
  if mesh is None:
    return 1
  return int(dict(mesh.shape).get(TP, 1))


def check_mesh(mesh: Mesh, config: TransformerConfig, path: Any, names: Mapping[str, Any]) -> None:
  """Raise a `CheckpointError` naming the tensor when `mesh` cannot split the model.

  Args:
    mesh: the device mesh (axis 'tp' splits; other axes replicate the params).
    config: the model's hyperparameters.
    path: the file, for the messages.
    names: the file's tensor names (to name the first layer's tensors in the messages).
  """
  if TP not in mesh.axis_names:
    raise CheckpointError(
      f"{path}: the mesh has axes {tuple(mesh.axis_names)}; load_gguf splits the weights"
      f" along an axis named {TP!r} (give it size 1 to replicate them)"
    )
  tp = tp_size(mesh)
  c = config
  first = "blk.0" if "blk.0.attn_q.weight" in names else "blk.*"
  problems = []
  for tensor, heads, what in (
    ("attn_q", c.heads, "query heads"),
    ("attn_k", c.kv_heads, "key/value heads"),
    ("attn_v", c.kv_heads, "key/value heads"),
  ):
    if heads % tp:
      problems.append(
        f"tensor '{first}.{tensor}.weight' (and every layer's): {heads} {what} do not split"
        f" over mesh axis {TP!r} of size {tp} (a head would be cut across devices); use a"
        f" 'tp' size that divides {heads}"
      )
  if c.experts % tp:
    problems.append(
      f"tensor '{first}.ffn_up_exps.weight' (and every layer's experts): {c.experts} experts do"
      f" not split over mesh axis {TP!r} of size {tp} (each device holds whole experts); use a"
      f" 'tp' size that divides {c.experts}"
    )
  dense_k = () if c.experts else (("ffn_down", c.ffn),)
  for tensor, k in (("attn_output", c.heads * c.head_dim), *dense_k):
    if k % (BLOCK * tp):
      problems.append(
        f"tensor '{first}.{tensor}.weight' (and every layer's): its K={k} rows split over"
        f" mesh axis {TP!r} of size {tp} give {k / tp:g} rows per device, which cuts a"
        f" {BLOCK}-row Q8_0 block (K must be a multiple of {BLOCK * tp})"
      )
  if problems:
    raise CheckpointError(
      f"{path}: the mesh {dict(mesh.shape)} cannot split this model:\n" + "\n".join(problems)
    )


def cache_spec(config: TransformerConfig, mesh: Mesh) -> P:
  """The KV cache's spec on `mesh`: kv_heads (axis 3) along 'tp' when it divides them."""
  tp = tp_size(mesh)
  if tp > 1 and config.kv_heads % tp == 0:
    return P(None, None, None, TP, None)
  return P()


def init_cache_on(config: TransformerConfig, length: int, mesh: Mesh | None, batch: int = 1) -> Any:
  """`init_cache(config, length, batch)` (one (k, v) pair, or one per layer kind when some
  layers are local), each (layers, batch, length, kv_heads, head_dim) zeros in
  `config.dtype`, placed on `mesh` by `cache_spec` (no mesh: as `init_cache`). Created in
  place on each device: no process holds the whole cache."""
  if mesh is None:
    return init_cache(config, length, batch)
  shape = jax.eval_shape(lambda: init_cache(config, length, batch))
  sharding = NamedSharding(mesh, cache_spec(config, mesh))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=sharding), shape)


def on_mesh(value: Any, mesh: Mesh | None, dtype: Any = jnp.int32) -> jax.Array:
  """A host value (the same on every process) as a `dtype` array replicated over `mesh`
  (no mesh: on the default device)."""
  host = np.asarray(value, dtype)
  if mesh is None:
    return jnp.asarray(host)
  sharding = NamedSharding(mesh, P())
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x: jax.Array) -> np.ndarray:
  """`x` as numpy on every process: read from a local shard when replicated or local,
  gathered across processes (a collective: every process must call it) when split."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


__all__ = [
  "TP",
  "cache_spec",
  "check_mesh",
  "init_cache_on",
  "on_mesh",
  "tp_size",
  "to_host",
]
