"""Small built-in Flax models, written as any Flax user would (no quantization in them)."""

from q8rules.models.llama import Decoder, DecoderConfig, init_cache

__all__ = ["Decoder", "DecoderConfig", "init_cache"]
