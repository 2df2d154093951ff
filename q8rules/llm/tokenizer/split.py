"""llama.cpp's pre-tokenizer: `unicode_regex_split` (src/unicode.cpp) in Python.

A pre-tokenizer is a list of regexes applied one after the other, each splitting
every piece the previous ones left ("isolated": the text between matches is a piece
too). A regex that is one of llama.cpp's hand-written splitters runs that splitter
(split_custom.py); any other runs on Python's `re` the way llama.cpp runs it on
std::regex: a regex with `\\p{..}` classes sees a "collapsed" text in which every
non-ASCII codepoint is replaced by one byte naming its category (0xD1 number, 0xD2
letter, 0xD3 punctuation, 0xD4 mark, 0xD5 symbol, 0xD0 other, 0x0B whitespace) and
each class by those bytes plus its ASCII members; a regex without them sees the
text with non-ASCII whitespace as 0x0B. `\\s`, `\\d`, `\\w` are ASCII-only, as in
the C locale, and `$` is the end of the piece (ECMAScript's, not Python's).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from q8rules.llm.tokenizer.split_custom import CUSTOM
from q8rules.llm.tokenizer.unicode import (
  BYTE_TO_UNICODE,
  CATEGORIES,
  LETTER,
  MARK,
  NUMBER,
  PUNCTUATION,
  SYMBOL,
  WHITESPACE,
  flags,
)

_UCAT = {  # \p{..} -> category (llama.cpp's k_ucat_enum); \p{Lu} etc. collapse to \p{L}
  r"\p{N}": NUMBER,
  r"\p{L}": LETTER,
  r"\p{P}": PUNCTUATION,
  r"\p{M}": MARK,
  r"\p{S}": SYMBOL,
  r"\p{Lu}": LETTER,
  r"\p{Ll}": LETTER,
  r"\p{Lt}": LETTER,
  r"\p{Lm}": LETTER,
  r"\p{Lo}": LETTER,
}
_CAT_CHAR = {NUMBER: "\xd1", LETTER: "\xd2", PUNCTUATION: "\xd3", MARK: "\xd4", SYMBOL: "\xd5"}
_CAT_ASCII = {  # the ASCII members of each class (k_ucat_map)
  NUMBER: "0-9",
  LETTER: "A-Za-z",
  PUNCTUATION: r"!-#%-*,-/:-;?-@\[-\]_\{\}",
  MARK: "",
  SYMBOL: r"\$\+<->^`\|\~",
}


def _collapse_char(ch: str) -> str:
  if ord(ch) < 128:
    return ch
  f = flags(ch)
  if f & WHITESPACE:
    return "\x0b"
  return _CAT_CHAR.get(f & CATEGORIES, "\xd0")


def collapse_text(text: str) -> str:
  """Each non-ASCII codepoint as the byte of its category (see the module docstring)."""
  return "".join(_collapse_char(c) for c in text)


def collapse_regex(regex: str) -> str:
  """`regex` with each `\\p{..}` class as its collapsed members (llama.cpp's rewrite)."""
  if any(ord(c) >= 128 for c in regex):
    raise ValueError(f"regex {regex!r}: unicode categories and non-ASCII characters together")
  out, inside, i = [], False, 0
  while i < len(regex):
    c = regex[i]
    if c == "[" and (i == 0 or regex[i - 1] != "\\"):
      out.append("[")
      inside, i = True, i + 1
      continue
    if inside and c == "]" and regex[i - 1] != "\\":
      out.append("]")
      inside, i = False, i + 1
      continue
    close = regex.find("}", i + 3) if regex.startswith("\\p{", i) else -1
    if 0 <= close <= i + 10 and regex[i : close + 1] in _UCAT:
      cat = _UCAT[regex[i : close + 1]]
      members = _CAT_CHAR[cat] + _CAT_ASCII[cat]
      out.append(members if inside else f"[{members}]")
      i = close + 1
      continue
    out.append(c)
    i += 1
  return "".join(out)


def _ecmascript_to_python(regex: str) -> str:
  """An unescaped `$` outside a class means the end of the input in ECMAScript."""
  out, inside, escaped = [], False, False
  for c in regex:
    if escaped:
      escaped = False
    elif c == "\\":
      escaped = True
    elif c == "[":
      inside = True
    elif c == "]":
      inside = False
    elif c == "$" and not inside:
      out.append(r"\Z")
      continue
    out.append(c)
  return "".join(out)


@functools.lru_cache(maxsize=256)
def compiled(regex: str) -> tuple[re.Pattern[str], bool]:
  """(the Python pattern llama.cpp's std::regex run of `regex` equals, uses collapsed text)."""
  collapsed = any(u in regex for u in _UCAT)
  pattern = collapse_regex(regex) if collapsed else regex
  return re.compile(_ecmascript_to_python(pattern), re.ASCII), collapsed


def _regex_offsets(subject: str, pattern: re.Pattern[str], offsets: Sequence[int]) -> list[int]:
  out, start = [], 0
  for n in offsets:
    last = 0
    for m in pattern.finditer(subject[start : start + n]):
      if m.start() > last:
        out.append(m.start() - last)
      out.append(m.end() - m.start())
      last = m.end()
    if last < n:
      out.append(n - last)
    start += n
  return out


def split_offsets(text: str, regexes: Sequence[str]) -> list[int]:
  """The lengths (codepoints) of the pieces `regexes` split `text` into, in order."""
  offsets: list[int] = [len(text)]
  plain = None
  for regex in regexes:
    custom = CUSTOM.get(regex)
    if custom is not None:
      offsets = custom(text, offsets)
      continue
    pattern, collapsed = compiled(regex)
    if collapsed:
      subject = collapse_text(text)
    else:
      if plain is None:
        plain = "".join("\x0b" if ord(c) > 0x7F and flags(c) & WHITESPACE else c for c in text)
      subject = plain
    offsets = _regex_offsets(subject, pattern, offsets)
  return offsets


def pre_split(text: str, regexes: Sequence[str], *, byte_encode: bool) -> list[str]:
  """`text` split into words by `regexes`; each word's UTF-8 bytes as GPT-2's printable
  characters when byte_encode (byte-level BPE), else the text as it is."""
  words, start = [], 0
  for n in split_offsets(text, regexes):
    words.append(text[start : start + n])
    start += n
  if byte_encode:
    return ["".join(BYTE_TO_UNICODE[b] for b in w.encode("utf-8")) for w in words]
  return words
