"""Checkpoints: GGUF files (llama.cpp's Q8_0) and safetensors, into quantized Flax params.

Modules:
  gguf: `load(path) -> GGUFCheckpoint`, a lazy mapping of a GGUF file's tensors
    (Q8_0 repacked into `Q8Array`s without dequantising), `save`, and
    `open_gguf` (one file, or every part of a split one, as one mapping).
  safetensors: `save(path, params)` / `load(path)` of Q8 param trees, bit exact.
  assign: `assign(q8_params, tensors, name_map)`, putting loaded tensors into a
    quantized model's param tree with every shape checked; `flatten(tree)`.

LoRA adapters' files are `q8rules.lora` (`safetensors_file`, `gguf_file`).

Errors are `CheckpointError` (a ValueError) naming the file and tensor.
"""

from q8rules.checkpoint import assign, gguf, safetensors
from q8rules.checkpoint._common import CheckpointError

__all__ = ["CheckpointError", "assign", "gguf", "safetensors"]
