"""Ids -> text as llama.cpp's `llama_detokenize` (with `token_to_piece`) does it.

A piece is a token's text with U+2581 as a space (SentencePiece, WordPiece,
SentencePiece-style BPE), GPT-2 byte characters back to bytes (byte-level BPE), or
the byte of a '<0xXX>' token; control and unknown tokens give nothing unless
`special`. The first piece loses one leading space when the vocabulary adds a space
prefix; with clean_spaces the spaces before ?!., and some contractions go.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from q8rules.llm.tokenizer.attrs import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED
from q8rules.llm.tokenizer.unicode import UNICODE_TO_BYTE
from q8rules.llm.tokenizer.vocab import Vocab


def _decode_bytes(text: str) -> bytes:
  """GPT-2 byte characters -> bytes (llama.cpp's `llama_decode_text`)."""
  out = bytearray()
  for ch in text:
    b = UNICODE_TO_BYTE.get(ch)
    if b is not None:
      out.append(b)
    else:
      utf8 = ch.encode()
      out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode() + b"]"
  return bytes(out)


def piece(vocab: Vocab, tid: int, *, special: bool) -> bytes:
  """The bytes token `tid` stands for (llama.cpp's `token_to_piece`, lstrip 0)."""
  attr, text = vocab.attrs[tid], vocab.tokens[tid]
  if attr & (UNKNOWN | CONTROL) and not special:
    return b""
  if attr & (UNKNOWN | CONTROL | USER_DEFINED):
    return text.encode()
  if attr & NORMAL:
    if vocab.kind != "bpe" or vocab.escape_whitespaces:
      return text.replace("\u2581", " ").encode()
    return _decode_bytes(text)
  if attr & BYTE:
    return bytes([int(text[3:5], 16)])
  return b""


_CLEANED = re.compile(rb" [?!.,']")
"""What the clean-up passes can change: a space before ? ! . , or '."""


def _clean_spaces(text: bytes) -> bytes:
  """llama.cpp's three clean-up passes, in place as it does them (pass 2 zeroes the space
  it drops, so " ' ' " is cleaned once). Each pass changes only a space before one of
  ?!.,' : text without such a pair comes back as it is, without the byte loops."""
  if not _CLEANED.search(text):
    return text
  t, n = bytearray(text), len(text)
  for step in (1, 2, 3):
    total, i = min(n, 1), 1
    while i < n:
      x = t[i]
      if step == 1 and t[i - 1] == 0x20 and x in b"?!.,":
        total -= 1
      elif step == 2 and x == 0x27 and i + 1 < n and t[i - 1] == 0x20 == t[i + 1]:
        total -= 1
        i += 1
        t[i] = 0
      elif step == 3 and t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
        x1, x2 = t[i + 1], t[i + 2] if i + 2 < n else None
        if x1 in b"sm" or (x2 is not None and (x1, x2) in ((0x72, 0x65), (0x76, 0x65))):
          total -= 1  # " 's" " 'm" " 're" " 've"
      t[total] = x
      total += 1
      i += 1
    n = total
  return bytes(t[:n])


def detokenize(vocab: Vocab, ids: Sequence[int], *, special: bool) -> bytes:
  """llama.cpp's `llama_detokenize(ids, remove_special=false, unparse_special=special)`."""
  out, strip = bytearray(), vocab.add_space_prefix
  for tid in ids:
    p = piece(vocab, tid, special=special)
    if strip and p[:1] == b" ":
      p = p[1:]
    strip = False
    out += p
  return _clean_spaces(bytes(out)) if vocab.clean_spaces else bytes(out)
