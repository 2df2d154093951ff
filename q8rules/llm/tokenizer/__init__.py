"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), as llama.cpp runs it.

`GGUFTokenizer.from_metadata(meta, path=...)` (or `.from_gguf(path)`) gives token ids
equal to llama.cpp's `llama_tokenize` for every vocabulary of llama.cpp's tokenizer
test suite: SentencePiece (spm.py), byte-level BPE with every pre-tokenizer llama.cpp
knows (bpe.py, pre_types.py, split.py), Gemma 4's BPE and WordPiece (wpm.py).
docs/tokenizers.md says how each is reproduced and what differs.
"""

from q8rules.llm.tokenizer.api import GGUFTokenizer, read_metadata
from q8rules.llm.tokenizer.pre_types import PRE_TOKENIZERS, PreTokenizer

CONTROL = 3
"""llama.cpp's token type (`tokenizer.ggml.token_type`) of control tokens (BOS, EOS, ...)."""

__all__ = ["CONTROL", "PRE_TOKENIZERS", "GGUFTokenizer", "PreTokenizer", "read_metadata"]
