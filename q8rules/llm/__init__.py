"""Run llama.cpp GGUF models (archs llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3) in JAX with their Q8_0 weights as stored."""

from q8rules.llm.compile_cache import enable as enable_compile_cache
from q8rules.llm.config import SUPPORTED_ARCHS
from q8rules.llm.load import load_gguf
from q8rules.llm.model import GGUFModel

__all__ = ["SUPPORTED_ARCHS", "GGUFModel", "enable_compile_cache", "load_gguf"]
