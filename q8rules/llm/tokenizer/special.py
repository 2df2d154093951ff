"""Splitting text on special tokens before tokenizing (llama.cpp's `tokenizer_st_partition`).

Each control, user-defined and unknown token, longest first, cuts every text
fragment it occurs in; the pieces between are tokenized, the token is kept as its
id. Without parse_special only user-defined tokens cut (control and unknown tokens
in the text are plain text), as `llama_tokenize(..., parse_special=false)`. A token
with LSTRIP / RSTRIP also swallows the ASCII whitespace before / after it.
"""

from __future__ import annotations

from q8rules.llm.tokenizer.attrs import CONTROL, LSTRIP, RSTRIP, UNKNOWN
from q8rules.llm.tokenizer.vocab import Vocab

_SPACE = " \t\n\v\f\r"  # C's isspace


def _cut(text: str, token: str, tid: int, attr: int) -> list[str | int]:
  pieces: list[str | int] = []
  pos, end = 0, len(text)
  while pos < end:
    m = text.find(token, pos)
    if m < 0:
      pieces.append(text[pos:])
      break
    left = m
    if attr & LSTRIP:
      while left > pos and text[left - 1] in _SPACE:
        left -= 1
    if left > pos:
      pieces.append(text[pos:left])
    pieces.append(tid)
    pos = m + len(token)
    if attr & RSTRIP:
      while pos < end and text[pos] in _SPACE:
        pos += 1
  return pieces


def partition(vocab: Vocab, text: str, *, parse_special: bool) -> list[str | int]:
  """`text` as fragments: plain text (str) and special tokens (int ids), in order."""
  fragments: list[str | int] = [text] if text else []
  for tid in vocab.specials:
    attr = vocab.attrs[tid]
    if not parse_special and attr & (CONTROL | UNKNOWN):
      continue
    token = vocab.tokens[tid]
    if not any(isinstance(f, str) and token in f for f in fragments):
      continue
    cut: list[str | int] = []
    for f in fragments:
      cut.extend(_cut(f, token, tid, attr) if isinstance(f, str) else [f])
    fragments = cut
  return fragments
