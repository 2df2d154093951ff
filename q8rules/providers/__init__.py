"""Providers: how matched ops run (serving as Q8_0; QAT with Q8_0 fake quant; per shard on a mesh)."""

from q8rules.providers.lora import Q8LoraProvider, Q8LoraRule
from q8rules.providers.lora_merge import merge_lora
from q8rules.providers.lora_params import LoraAdapter, join_lora, split_lora
from q8rules.providers.mesh import shard_products
from q8rules.providers.params import quantize_params
from q8rules.providers.qat import Q8QatProvider
from q8rules.providers.serving import Q8Provider

__all__ = [
  "LoraAdapter",
  "Q8LoraProvider",
  "Q8LoraRule",
  "Q8Provider",
  "Q8QatProvider",
  "join_lora",
  "merge_lora",
  "quantize_params",
  "shard_products",
  "split_lora",
]
