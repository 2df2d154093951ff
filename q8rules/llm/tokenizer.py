"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), built on HF's `tokenizers`.

Supported: byte-level BPE (`tokenizer.ggml.model = 'gpt2'`), with the
pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre` in
PRE_TOKENIZERS (copied from llama.cpp's `llama-vocab.cpp`), including
llama.cpp's `ignore_merges` (a word that is itself a token is not split: Llama
3). Token ids equal llama.cpp's `llama_tokenize(..., add_special=True,
parse_special=False)`: BOS is prepended when the file says so
(`tokenizer.ggml.add_bos_token`, else llama.cpp's default for the pre type),
and control tokens in the text are not parsed as such.

Other tokenizer models (SentencePiece 'llama', WordPiece 'bert', ...) are
refused with an error; pass token ids to `GGUFModel` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from q8rules.checkpoint import CheckpointError

_LLAMA3 = (
  r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
  r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
  # tokenizer.ggml.pre -> (regex, ignore_merges, default add_bos), as llama.cpp
  "llama3": (_LLAMA3, True, True),
  "llama-v3": (_LLAMA3, True, True),
  "llama-bpe": (_LLAMA3, True, True),
  "qwen2": (_QWEN2, False, False),
  "deepseek-r1-qwen": (_QWEN2, False, False),
  "gpt-2": (_GPT2, False, False),
}
"""The `tokenizer.ggml.pre` values this tokenizer reproduces."""

CONTROL = 3
"""llama.cpp's token type of control tokens (BOS, EOS, ...): never produced from text,
dropped by `decode`."""


class GGUFTokenizer:
  """Text <-> llama.cpp token ids for a GGUF file's BPE vocabulary.

  Attributes:
    bos_id, eos_id: the file's BOS / EOS ids (None if absent).
    add_bos: whether `encode` prepends BOS by default.
    vocab_size: tokens in the vocabulary.
  """

  def __init__(
    self,
    tokens: Sequence[str],
    merges: Sequence[str],
    pre: str,
    *,
    token_types: Sequence[int] | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    add_bos: bool | None = None,
    path: str = "<tokenizer>",
  ):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
      raise CheckpointError(
        f"{path}: tokenizer.ggml.pre {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        " (pass token ids instead)"
      )
    regex, ignore_merges, default_bos = PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
    tok.decoder = decoders.ByteLevel()
    self._tok = tok
    self.vocab_size = len(tokens)
    self.bos_id, self.eos_id = bos_id, eos_id
    self.add_bos = default_bos if add_bos is None else bool(add_bos)
    types = list(token_types) if token_types is not None else [1] * len(tokens)
    self._control = {i for i, t in enumerate(types) if t == CONTROL}

  @classmethod
  def from_metadata(cls, meta: Mapping[str, Any], *, path: str = "<gguf>") -> GGUFTokenizer:
    """From `tokenizer.ggml.*` keys (`GGUFCheckpoint.metadata`)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
      raise CheckpointError(
        f"{path}: tokenizer.ggml.model {model!r} is not supported (only byte-level BPE,"
        " 'gpt2'); pass token ids instead"
      )
    return cls(
      meta["tokenizer.ggml.tokens"],
      meta.get("tokenizer.ggml.merges", []),
      meta.get("tokenizer.ggml.pre", "gpt-2"),
      token_types=meta.get("tokenizer.ggml.token_type"),
      bos_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_id=meta.get("tokenizer.ggml.eos_token_id"),
      add_bos=meta.get("tokenizer.ggml.add_bos_token"),
      path=path,
    )

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text` (BOS first when add_bos, default: the file's setting)."""
    ids = self._tok.encode(text, add_special_tokens=False).ids if text else []
    add = self.add_bos if add_bos is None else add_bos
    return ([self.bos_id] if add and self.bos_id is not None else []) + list(ids)

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`, control tokens (BOS, EOS, ...) left out."""
    return self._tok.decode(
      [int(i) for i in ids if int(i) not in self._control], skip_special_tokens=False
    )
