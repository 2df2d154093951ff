"""Providers: how matched ops run (serving as Q8_0; QAT with Q8_0 fake quant; per shard on a mesh)."""

from q8rules.providers.lora import Q8LoraProvider, Q8LoraRule
from q8rules.providers.mesh import shard_products
from q8rules.providers.qat import Q8QatProvider
from q8rules.providers.serving import Q8Provider, quantize_params

__all__ = [
  "Q8LoraProvider",
  "Q8LoraRule",
  "Q8Provider",
  "Q8QatProvider",
  "quantize_params",
  "shard_products",
]
