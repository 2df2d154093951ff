"""`LoadedModel`: what the helpers that rebuild, adapt or train a loaded GGUF model read of it
(`q8rules.llm.GGUFModel` is one). A Protocol, so that the helpers of `q8rules.lora` take the
loader's models without importing `q8rules.llm`: `q8rules.llm` imports `q8rules.lora` (its
models' `with_lora`, `merged`, `loss`, `load_gguf(lora=)`), never the reverse."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from flax import linen as nn

from q8rules.models.transformer import TransformerConfig


class LoadedModel(Protocol):
  """A model loaded from a GGUF file (`q8rules.llm.GGUFModel`'s fields and the methods the
  helpers call; see its docstring for each)."""

  path: Any
  config: TransformerConfig
  model: nn.Module
  params: Any
  metadata: dict[str, Any]
  tokenizer: Any
  mesh: Any
  lora: Any
  source: Any
  rule: Any
  provider_type: Any

  @property
  def product_specs(self) -> dict[str, Any]:
    """The per-layer specs its products are split by on its mesh."""
    ...

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Any:
    """The file's chat template over `messages` (token ids, or the text)."""
    ...


__all__ = ["LoadedModel"]
