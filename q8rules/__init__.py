"""q8rules: Qwix-style rules that serve Flax models with llama.cpp Q8_0 weights."""

from q8rules.kernels import q8_matmul
from q8rules.q8_0 import BLOCK, Q8Array, dequantize, quantize

__all__ = ["BLOCK", "Q8Array", "dequantize", "q8_matmul", "quantize"]
