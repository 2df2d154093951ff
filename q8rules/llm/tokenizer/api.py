"""`GGUFTokenizer`: text <-> token ids as llama.cpp's `llama_tokenize` / `llama_detokenize`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from q8rules.llm.tokenizer import detok, gguf_meta, spm, wpm
from q8rules.llm.tokenizer.attrs import CONTROL, UNKNOWN
from q8rules.llm.tokenizer.bpe import BPE
from q8rules.llm.tokenizer.special import partition
from q8rules.llm.tokenizer.vocab import Vocab

_KEYS = ("tokenizer.", "general.name", "general.architecture")


def read_metadata(path: str | Path) -> dict[str, Any]:
  """The tokenizer keys (and general.name / general.architecture) of a GGUF file as
  Python values (as `GGUFReader` gives them); the tensors are not read."""
  return gguf_meta.read_metadata(path, _KEYS)


class GGUFTokenizer:
  """Text <-> llama.cpp token ids for a GGUF file's vocabulary.

  Supports what llama.cpp's tokenizer test suite covers: SentencePiece ('llama'),
  byte-level BPE ('gpt2') with every pre-tokenizer llama.cpp knows, Gemma 4's BPE
  ('gemma4') and WordPiece ('bert'). Ids equal llama.cpp's `llama_tokenize`.

  Attributes:
    bos_id, eos_id: the BOS / EOS ids (llama.cpp's defaults where the file names none;
      None when the vocabulary has none).
    eog_ids: ids that end generation (EOS, EOT, <|im_end|>, ... as llama.cpp finds them).
    add_bos, add_eos: whether `encode` adds BOS / EOS by default (the file's
      add_bos_token / add_eos_token, else llama.cpp's default for the vocabulary).
    vocab_size: tokens in the vocabulary.
    vocab: the loaded `Vocab` (tokens, scores, attributes, flags).
  """

  def __init__(self, vocab: Vocab):
    self.vocab = vocab
    self.vocab_size = len(vocab.tokens)
    self.bos_id, self.eos_id = vocab.ids["bos"], vocab.ids["eos"]
    self.eog_ids = vocab.eog_ids
    self.add_bos, self.add_eos = vocab.add_bos, vocab.add_eos
    self._bpe = BPE(vocab) if vocab.kind == "bpe" else None

  @classmethod
  def from_metadata(cls, meta: Mapping[str, Any], *, path: str = "<gguf>") -> GGUFTokenizer:
    """From `tokenizer.ggml.*` keys (`GGUFCheckpoint.metadata`, `read_metadata`).

    Raises:
      CheckpointError: an unsupported tokenizer model or a malformed vocabulary, naming
        `path` and the key. An unknown `tokenizer.ggml.pre` warns and uses llama.cpp's
        default pre-tokenizer.
    """
    return cls(Vocab.from_metadata(meta, path=path))

  @classmethod
  def from_gguf(cls, path: str | Path) -> GGUFTokenizer:
    """From a GGUF file (a model or a vocabulary-only file), reading only its metadata."""
    return cls.from_metadata(read_metadata(path), path=str(path))

  def encode(
    self,
    text: str,
    *,
    add_special: bool = True,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    parse_special: bool = False,
  ) -> list[int]:
    """Token ids of `text`: llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

    Args:
      text: the text.
      add_special: add BOS / EOS as the vocabulary says (WordPiece: [CLS] ... [SEP]);
        False adds none, whatever add_bos / add_eos say.
      add_bos, add_eos: override the vocabulary's add_bos / add_eos (None: keep).
      parse_special: control tokens written in the text ('<s>', '<|im_end|>') become
        their ids; by default only user-defined tokens do, the rest is plain text.
    """
    v = self.vocab
    bos = add_special and (self.add_bos if add_bos is None else add_bos)
    eos = add_special and (self.add_eos if add_eos is None else add_eos)
    out: list[int] = []
    if bos or (v.kind == "wpm" and add_special and add_bos is None):
      out.append(self._need("bos"))
    after_special = True  # SentencePiece: a space prefix at the start and after a token
    for frag in partition(v, text, parse_special=parse_special):
      if isinstance(frag, int):
        out.append(frag)
        after_special = True
      elif v.kind == "spm":
        lead = " " if v.add_space_prefix and after_special else ""
        spm.tokenize(v, (lead + frag).replace(" ", "\u2581"), out)
        after_special = False
      elif v.kind == "wpm":
        wpm.tokenize(v, frag, out)
      else:
        assert self._bpe is not None
        self._bpe.tokenize(frag, out)
    if v.kind == "wpm" and add_special:
      out.append(self._need("sep"))
    elif eos:
      out.append(self._need("eos"))
    return out

  def decode(self, ids: Sequence[int], *, special: bool = False) -> str:
    """The text of `ids`.

    Control and unknown tokens (BOS, EOS, ...) are left out first unless `special`;
    the rest is llama.cpp's `llama_detokenize(ids, remove_special=False,
    unparse_special=special)`, so `decode(encode(text)) == text` wherever llama.cpp's
    detokenizer gives the text back (not for WordPiece, which lowercases, nor where
    clean_spaces drops a space, e.g. ' ?'). Bytes that are not UTF-8 become U+FFFD.
    """
    tids = [int(i) for i in ids]
    bad = [i for i in tids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"{self.vocab.path}: token ids {bad[:5]} not in [0, {self.vocab_size})")
    if not special:
      tids = [i for i in tids if not self.vocab.attrs[i] & (CONTROL | UNKNOWN)]
    return detok.detokenize(self.vocab, tids, special=special).decode("utf-8", "replace")

  def _need(self, role: str) -> int:
    tid = self.vocab.ids[role]
    if tid is None:
      raise ValueError(f"{self.vocab.path}: encode needs a {role.upper()} token; the file has none")
    return tid
