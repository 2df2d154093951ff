"""llama.cpp's WordPiece tokenizer (`llm_tokenizer_wpm_session`, BERT).

The text is normalized (each codepoint to the first codepoint of its NFD form and
accents dropped when strip_accents, lowercased when lowercase, control characters
dropped) and split on whitespace, punctuation, ASCII symbols and CJK characters.
Each word, with U+2581 in front, is then covered greedily by the longest tokens;
a word that cannot be covered is the unknown token.
"""

from __future__ import annotations

from q8rules.llm.tokenizer.unicode import (
  CONTROL,
  MARK,
  PUNCTUATION,
  SYMBOL,
  WHITESPACE,
  flags,
  nfd_first,
  tolower,
)
from q8rules.llm.tokenizer.vocab import Vocab

_CJK = (
  (0x4E00, 0x9FFF),
  (0x3400, 0x4DBF),
  (0x20000, 0x2A6DF),
  (0x2A700, 0x2B73F),
  (0x2B740, 0x2B81F),
  (0x2B920, 0x2CEAF),  # llama.cpp follows HF's 0x2B920 here (Unicode: 0x2B820)
  (0xF900, 0xFAFF),
  (0x2F800, 0x2FA1F),
)


def is_chinese_char(cp: int) -> bool:
  """llama.cpp's `is_chinese_char` (BERT's CJK ranges)."""
  return any(lo <= cp <= hi for lo, hi in _CJK)


def words(text: str, *, lowercase: bool, strip_accents: bool) -> list[str]:
  """The normalized words of `text` (llama.cpp's `preprocess`)."""
  out = [""]
  for ch in text:
    if strip_accents:
      ch = nfd_first(ch)
    f, cp = flags(ch), ord(ch)
    if f & WHITESPACE:
      if out[-1]:
        out.append("")
      continue
    if cp == 0 or cp == 0xFFFD or f & CONTROL or (strip_accents and f & MARK):
      continue
    s = tolower(ch) if lowercase else ch
    if f & PUNCTUATION or (cp < 0x7F and f & SYMBOL) or is_chinese_char(cp):
      if out[-1]:
        out.append("")
      out[-1] = s
      out.append("")
    else:
      out[-1] += s
  if not out[-1]:
    out.pop()
  return out


def tokenize(vocab: Vocab, text: str, out: list[int]) -> None:
  """Append the ids of `text` (one fragment between special tokens) to `out`."""
  t2id, longest = vocab.token_to_id, vocab.max_token_len
  for word in words(text, lowercase=vocab.lowercase, strip_accents=vocab.strip_accents):
    w = "\u2581" + word
    n, start, i = len(w), len(out), 0
    while i < n:
      for j in range(min(n, i + longest), i, -1):
        tid = t2id.get(w[i:j])
        if tid is not None:
          out.append(tid)
          i = j
          break
      else:
        del out[start:]  # a part no token covers: the whole word is unknown
        break
    if len(out) == start:
      unk = vocab.ids["unk"]
      if unk is None:
        raise ValueError(f"{vocab.path}: {word!r} needs the unknown token; the file has none")
      out.append(unk)
