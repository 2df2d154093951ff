"""The one built-in model: a config-driven decoder in plain Flax, with no quantization in it.

`Transformer(TransformerConfig(...))` is what the demo, the README, the notebooks and
`q8rules.llm.load_gguf` run; `qwix.quantize_model` with `q8rules.Q8Rule`s quantizes it.
"""

from q8rules.models.transformer import Cache, Transformer, TransformerConfig, init_cache

__all__ = ["Cache", "Transformer", "TransformerConfig", "init_cache"]
