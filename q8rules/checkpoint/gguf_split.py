"""Kept for `q8rules.llm.model`'s import: split GGUF files are `q8rules.checkpoint.gguf.split`,
and `open_gguf` is also `q8rules.checkpoint.gguf.open_gguf`."""

from q8rules.checkpoint.gguf.split import SPLIT_NAME, GGUFSplitCheckpoint, open_gguf

__all__ = ["SPLIT_NAME", "GGUFSplitCheckpoint", "open_gguf"]
