"""q8rules: Qwix-style rules that serve Flax models with llama.cpp Q8_0 weights.

`import q8rules` loads the core only (the format, the rules, the providers, the
kernels, sharding). The applications (`q8rules.checkpoint`, `q8rules.llm`,
`q8rules.models`) load on first use: `q8rules.load_gguf`, `q8rules.checkpoint`,
`q8rules.save_lora` and `q8rules.load_lora` are resolved lazily, so gguf, safetensors and
tokenizers are imported only when a checkpoint is touched; `from q8rules import *` takes the core only (`__all__`).
"""

from __future__ import annotations

import importlib
from typing import Any

from q8rules import kernels, sharding
from q8rules.kernels import export_checks, fold_applies, q8_matmul
from q8rules.layout import Q8How
from q8rules.lora.merge import merge_lora
from q8rules.lora.params import LoraAdapter, join_lora, split_lora
from q8rules.lora.provider import Q8LoraProvider, Q8LoraRule
from q8rules.providers import Q8Provider, Q8QatProvider, quantize_params, shard_products
from q8rules.q8_0 import BLOCK, Q8Array, dequantize, quantize
from q8rules.report import OpRecord, Report
from q8rules.rules import Q8Rule

_LAZY = {
  "checkpoint": ("q8rules.checkpoint", None),
  "llm": ("q8rules.llm", None),
  "models": ("q8rules.models", None),
  "load_gguf": ("q8rules.llm", "load_gguf"),
  "save_lora": ("q8rules.lora.safetensors_file", "save_lora"),
  "load_lora": ("q8rules.lora.safetensors_file", "load_lora"),
  "set_cpu_threads": ("q8rules.kernels.native.threads", "set_threads"),
  "serve": ("q8rules.serve", None),  # the package, callable as its `serve`
}
"""Application names resolved on first use (module, attribute)."""


def __getattr__(name: str) -> Any:
  if name not in _LAZY:
    raise AttributeError(f"module 'q8rules' has no attribute {name!r}")
  module, attr = _LAZY[name]
  value = importlib.import_module(module)
  if attr is not None:
    value = getattr(value, attr)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
  "BLOCK",
  "LoraAdapter",
  "OpRecord",
  "Q8LoraProvider",
  "Q8LoraRule",
  "Q8Array",
  "Q8How",
  "Q8Provider",
  "Q8QatProvider",
  "Q8Rule",
  "Report",
  "dequantize",
  "export_checks",
  "fold_applies",
  "join_lora",
  "kernels",
  "merge_lora",
  "q8_matmul",
  "quantize",
  "quantize_params",
  "shard_products",
  "sharding",
  "split_lora",
]
