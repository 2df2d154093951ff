"""llama.cpp's BPE (`llm_tokenizer_bpe_session`): pre-tokenize, then merge each word.

Each word of the pre-tokenizer (split.py) is split into characters and the adjacent
pair with the lowest merge rank is merged, leftmost first, until no pair has a
rank. A finished piece that is not a token becomes its bytes' tokens (byte-level
BPE: the single-byte token of each ASCII byte, other bytes dropped, as llama.cpp
does; Gemma 4 style: '<0xXX>'). Words repeat, so their ids are cached.
"""

from __future__ import annotations

from q8rules.llm.tokenizer.merges import merge_pairs
from q8rules.llm.tokenizer.split import pre_split
from q8rules.llm.tokenizer.vocab import Vocab

_CACHE_WORDS = 1 << 16


def merge(word: str, ranks: dict[str, int]) -> list[str]:
  """`word`'s pieces after llama.cpp's BPE merges (`ranks`: 'left right' -> rank)."""
  return merge_pairs(word, lambda left, right: ranks.get(left + " " + right))


class BPE:
  """Text -> ids for one BPE vocabulary (`vocab.kind == 'bpe'`)."""

  def __init__(self, vocab: Vocab):
    assert vocab.pre is not None
    self.vocab, self.pre = vocab, vocab.pre
    self._gemma4 = vocab.pre.kind == "gemma4"
    self._cache: dict[str, list[int]] = {}

  def tokenize(self, text: str, out: list[int]) -> None:
    """Append the ids of `text` (one fragment between special tokens) to `out`."""
    if self.vocab.escape_whitespaces:
      text = text.replace(" ", "\u2581")
    for word in pre_split(text, self.pre.regexes, byte_encode=self.pre.byte_encode):
      ids = self._cache.get(word)
      if ids is None:
        ids = self._word(word)
        if len(self._cache) < _CACHE_WORDS:
          self._cache[word] = ids
      out.extend(ids)

  def _word(self, word: str) -> list[int]:
    t2id = self.vocab.token_to_id
    whole = word in t2id and (self.vocab.ignore_merges or (self._gemma4 and not word.strip("\n")))
    pieces = [word] if whole else merge(word, self.vocab.ranks)
    ids = []
    for piece in pieces:
      tid = t2id.get(piece)
      if tid is not None:
        ids.append(tid)
        continue
      for b in piece.encode("utf-8"):
        if self.pre.byte_encode:
          tid = t2id.get(chr(b)) if b < 0x80 else None
        else:
          tid = t2id.get(f"<0x{b:02X}>")
        if tid is not None:
          ids.append(tid)
    return ids
