"""q8rules: Qwix-style rules that serve Flax models with llama.cpp Q8_0 weights."""

from q8rules import checkpoint, kernels, sharding
from q8rules.kernels import fold_applies, q8_matmul
from q8rules.layout import Q8How
from q8rules.llm import load_gguf
from q8rules.providers import Q8Provider, Q8QatProvider, quantize_params, shard_products
from q8rules.q8_0 import BLOCK, Q8Array, dequantize, quantize
from q8rules.report import OpRecord, Report
from q8rules.rules import Q8Rule

__all__ = [
  "BLOCK",
  "OpRecord",
  "Q8Array",
  "Q8How",
  "Q8Provider",
  "Q8QatProvider",
  "Q8Rule",
  "Report",
  "checkpoint",
  "dequantize",
  "fold_applies",
  "load_gguf",
  "kernels",
  "q8_matmul",
  "quantize",
  "quantize_params",
  "shard_products",
  "sharding",
]
