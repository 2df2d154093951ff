"""q8rules: Qwix-style rules that serve Flax models with llama.cpp Q8_0 weights.

`import q8rules` loads nothing but this module: every name below resolves on first use (PEP 562
`__getattr__`), so `import q8rules` costs no JAX import and `q8rules --help` answers at once.
`q8rules.Q8Provider` loads the core (the format, the rules, the providers, the kernels,
sharding: JAX, Flax and Qwix); `from q8rules import *` takes the core too (`__all__`). The
applications (`q8rules.checkpoint`, `q8rules.llm`, `q8rules.models`, `q8rules.load_gguf`,
`q8rules.save_lora`, ...) load only when named, so gguf, safetensors and tokenizers are imported
only when a checkpoint is touched. Any submodule (`q8rules.lora`, `q8rules.q8_0`, ...) is an
attribute as well, imported when first read.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_CORE = {
  "kernels": ("q8rules.kernels", None),
  "sharding": ("q8rules.sharding", None),
  "export_checks": ("q8rules.kernels", "export_checks"),
  "fold_applies": ("q8rules.kernels", "fold_applies"),
  "q8_matmul": ("q8rules.kernels", "q8_matmul"),
  "Q8How": ("q8rules.layout", "Q8How"),
  "merge_lora": ("q8rules.lora.merge", "merge_lora"),
  "LoraAdapter": ("q8rules.lora.params", "LoraAdapter"),
  "join_lora": ("q8rules.lora.params", "join_lora"),
  "split_lora": ("q8rules.lora.params", "split_lora"),
  "Q8LoraProvider": ("q8rules.lora.provider", "Q8LoraProvider"),
  "Q8LoraRule": ("q8rules.lora.provider", "Q8LoraRule"),
  "Q8Provider": ("q8rules.providers", "Q8Provider"),
  "Q8QatProvider": ("q8rules.providers", "Q8QatProvider"),
  "quantize_params": ("q8rules.providers", "quantize_params"),
  "shard_products": ("q8rules.providers", "shard_products"),
  "BLOCK": ("q8rules.q8_0", "BLOCK"),
  "Q8Array": ("q8rules.q8_0", "Q8Array"),
  "dequantize": ("q8rules.q8_0", "dequantize"),
  "quantize": ("q8rules.q8_0", "quantize"),
  "OpRecord": ("q8rules.report", "OpRecord"),
  "Report": ("q8rules.report", "Report"),
  "Q8Rule": ("q8rules.rules", "Q8Rule"),
}
"""The core's names (`__all__`), resolved on first use: (module, attribute; None: the module)."""

_APPLICATIONS = {
  "checkpoint": ("q8rules.checkpoint", None),
  "llm": ("q8rules.llm", None),
  "models": ("q8rules.models", None),
  "load_gguf": ("q8rules.llm", "load_gguf"),
  "save_lora": ("q8rules.lora.safetensors_file", "save_lora"),
  "load_lora": ("q8rules.lora.safetensors_file", "load_lora"),
  "set_cpu_threads": ("q8rules.kernels.native.threads", "set_threads"),
  "serve": ("q8rules.serve", None),  # the package, callable as its `serve`
}
"""Application names resolved on first use and left out of `__all__` (module, attribute)."""

_LAZY = {**_CORE, **_APPLICATIONS}


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    module, attr = _LAZY[name]
  elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    module, attr = f"{__name__}.{name}", None  # a submodule, as `import q8rules.name` binds it
  else:
    raise AttributeError(f"module 'q8rules' has no attribute {name!r}")
  value = importlib.import_module(module)
  if attr is not None:
    value = getattr(value, attr)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_CORE)
