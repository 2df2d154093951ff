"""Tensor-parallel Q8_0 on a device mesh, with JAX's own SPMD machinery.

`specs`: PartitionSpecs for Q8_0 weights; `product`: a product per shard in
`shard_map`; `params`: placing a Q8 param tree; `adapters`: a LoRA adapter's spec beside
its Q8_0 base's split. The provider's mesh context,
`q8rules.shard_products`, lives in `q8rules.providers.mesh`.

Limits: a model that calls `shard_map` itself around a weight does not get
that weight quantized (inside the map Qwix sees a per-device tracer it cannot
trace back to the param; the report says 'float'); write the model without
its own `shard_map` and split it with `shard_params` + `shard_products`. A K
split must fall on whole 32-row blocks of the unpadded K, and a split float
axis must be the leading (longer than 1) axis of those flattened into K or N.
"""

from q8rules.sharding.params import param_shardings, path_str, shard_params
from q8rules.sharding.product import q8_matmul_sharded
from q8rules.sharding.specs import check_q8_spec, q8_sharding, q8_spec_for_layout, shard_q8

__all__ = [
  "check_q8_spec",
  "param_shardings",
  "path_str",
  "q8_matmul_sharded",
  "q8_sharding",
  "q8_spec_for_layout",
  "shard_params",
  "shard_q8",
]
