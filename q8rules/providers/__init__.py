"""Providers: how matched ops run (serving as Q8_0; QAT with Q8_0 fake quant; per shard on a
mesh). LoRA on a Q8_0 base is `q8rules.lora`."""

from q8rules.providers.mesh import shard_products
from q8rules.providers.params import quantize_params
from q8rules.providers.qat import Q8QatProvider
from q8rules.providers.serving import Q8Provider

__all__ = [
  "Q8Provider",
  "Q8QatProvider",
  "quantize_params",
  "shard_products",
]
