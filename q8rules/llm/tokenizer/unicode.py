"""Codepoint facts as llama.cpp's src/unicode.cpp has them: category flags, whitespace,
lowercase, the first codepoint of NFD, and GPT-2's byte <-> printable-character map.

Categories come from llama.cpp's own table (`_unicode_table.py`, generated from its
unicode-data.cpp, a newer Unicode than Python 3.11's `unicodedata`), so a codepoint
that Unicode assigned after Python's version is classified as llama.cpp does.
Lowercase and NFD come from `unicodedata`: on Python 3.11 they equal llama.cpp's
tables for every codepoint (compared once with its unicode-data.cpp).
"""

from __future__ import annotations

import base64
import bisect
import functools
import struct
import unicodedata
import zlib

from q8rules.llm.tokenizer._unicode_table import RANGES

UNDEFINED = 0x0001
NUMBER = 0x0002  # \p{N}
LETTER = 0x0004  # \p{L}
SEPARATOR = 0x0008  # \p{Z}
MARK = 0x0010  # \p{M}
PUNCTUATION = 0x0020  # \p{P}
SYMBOL = 0x0040  # \p{S}
CONTROL = 0x0080  # \p{C}
CATEGORIES = 0x00FF
WHITESPACE = 0x0100  # \s as llama.cpp's custom splitters see it

WHITESPACE_CODEPOINTS = frozenset(
  [*range(0x09, 0x0E), *range(0x2000, 0x200B), 0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029]
  + [0x202F, 0x205F, 0x3000]
)
"""Unicode's White_Space property, as llama.cpp's gen-unicode-data.py lists it."""


def _unpack(blob: str) -> tuple[list[int], list[int]]:
  raw = zlib.decompress(base64.b85decode(blob))
  starts, flags, pos = [], [], 0
  for delta, flag in struct.iter_unpack("<IB", raw):
    pos += delta
    starts.append(pos)
    flags.append(flag)
  return starts, flags


_STARTS, _FLAGS = _unpack("".join(RANGES))


@functools.lru_cache(maxsize=1 << 16)
def flags(ch: str) -> int:
  """llama.cpp's `unicode_cpt_flags_from_cpt` of one character: category | WHITESPACE."""
  cp = ord(ch)
  f = _FLAGS[bisect.bisect_right(_STARTS, cp) - 1]
  return f | WHITESPACE if cp in WHITESPACE_CODEPOINTS else f


def flags_of(text: str) -> list[int]:
  """`flags` of each character of `text`."""
  return [flags(c) for c in text]


@functools.lru_cache(maxsize=1 << 14)
def tolower(ch: str) -> str:
  """Unicode's simple lowercase mapping of one character (llama.cpp's `unicode_tolower`)."""
  low = ch.lower()
  return low[0] if low != ch else ch


@functools.lru_cache(maxsize=1 << 14)
def nfd_first(ch: str) -> str:
  """The first codepoint of `ch`'s NFD form (llama.cpp's `unicode_cpts_normalize_nfd`)."""
  return unicodedata.normalize("NFD", ch)[0]


def _byte_to_unicode() -> list[str]:
  printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  table, n = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + n)
      n += 1
  return [table[b] for b in range(256)]


BYTE_TO_UNICODE: list[str] = _byte_to_unicode()
"""GPT-2's map of each byte to a printable character (llama.cpp's `unicode_byte_to_utf8`)."""

UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
