"""Run llama.cpp GGUF models (the archs of q8rules/llm/archs/: llama, qwen2, qwen3, qwen3moe,
gemma, gemma2, gemma3, gemma4, phi3, gpt-oss) in JAX with their Q8_0 weights as stored.

`load_gguf`, `GGUFModel`, `SUPPORTED_ARCHS` and `enable_compile_cache` load on first use, so
importing one module of the package (`q8rules.llm.compile_cache` from the command line) does not
load the loader and the model with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
  "SUPPORTED_ARCHS": ("q8rules.llm.archs", "ARCHS"),
  "GGUFModel": ("q8rules.llm.model", "GGUFModel"),
  "enable_compile_cache": ("q8rules.llm.compile_cache", "enable"),
  "load_gguf": ("q8rules.llm.load", "load_gguf"),
}
"""Name -> (module, attribute), resolved on first use."""


def __getattr__(name: str) -> Any:
  if name not in _LAZY:
    raise AttributeError(f"module 'q8rules.llm' has no attribute {name!r}")
  module, attr = _LAZY[name]
  value = getattr(importlib.import_module(module), attr)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


__all__ = ["SUPPORTED_ARCHS", "GGUFModel", "enable_compile_cache", "load_gguf"]
