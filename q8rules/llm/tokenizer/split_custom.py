"""llama.cpp's hand-written pre-tokenizer splitters (src/unicode.cpp `unicode_regex_split_custom_*`).

llama.cpp runs these instead of a regex engine when a pre-tokenizer's regex is one
of the strings in `CUSTOM` below; they differ from what a regex engine does on
a few inputs (unassigned codepoints, the end of a text), so they are ported as they
are. Each takes the text and the current split (lengths in codepoints that sum to
len(text)) and returns the finer split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from q8rules.llm.tokenizer.unicode import LETTER, MARK, NUMBER, WHITESPACE, flags_of, tolower

Splitter = Callable[[str, Sequence[int]], list[int]]

_TWO = frozenset("stmd")
_THREE = frozenset([("r", "e"), ("v", "e"), ("l", "l")])


def _contraction(text: str, pos: int, end: int, *, fold: bool) -> int:
  """Length of `'s|'t|'re|'ve|'m|'ll|'d` at pos (case-insensitive when fold), else 0."""
  if text[pos] != "'" or pos + 1 >= end:
    return 0
  a = tolower(text[pos + 1]) if fold else text[pos + 1]
  if a in _TWO:
    return 2
  if pos + 2 < end:
    b = tolower(text[pos + 2]) if fold else text[pos + 2]
    if (a, b) in _THREE:
      return 3
  return 0


class _Segment:
  """One segment [ini, end) of the text: flags / chars outside it read as 0 / ''."""

  def __init__(self, text: str, fl: list[int], ini: int, end: int, out: list[int]):
    self.text, self.fl, self.ini, self.end, self.out = text, fl, ini, end, out
    self.prev = ini

  def f(self, pos: int) -> int:
    return self.fl[pos] if self.ini <= pos < self.end else 0

  def c(self, pos: int) -> str:
    return self.text[pos] if self.ini <= pos < self.end else ""

  def add(self, end: int) -> int:
    n = end - self.prev
    if n > 0:
      self.out.append(n)
    self.prev = end
    return n

  def digits(self, pos: int, most: int) -> int:
    """`\\p{N}{1,most}` tokens over the run of numbers at pos; the run's end."""
    ini = pos
    while self.f(pos) & NUMBER:
      pos += 1
      if pos - ini >= most:
        self.add(pos)
        ini = pos
    self.add(pos)
    return pos

  def non_word(self, pos: int, word: int) -> int:
    """The end of ` ?[^<word>]+` at pos (`word`: the flags that end it)."""
    pos += self.text[pos] == " "
    while not self.f(pos) & word and self.f(pos):
      pos += 1
    return pos

  def newlines(self, pos: int) -> int:
    """pos moved past a run of '\\r' / '\\n'."""
    while self.c(pos) in ("\r", "\n"):
      pos += 1
    return pos

  def whitespace(self, pos: int, *, newline_runs: bool) -> int:
    """The end of the whitespace token at pos (`\\s*[\\r\\n]+` when newline_runs, then
    `\\s+(?!\\S)`, `\\s+`), or pos + 1 when pos is not whitespace."""
    n, last_rn = 0, 0
    while self.f(pos + n) & WHITESPACE:
      if newline_runs and self.text[pos + n] in "\r\n":
        last_rn = pos + n + 1
      n += 1
    if last_rn > 0:
      return last_rn
    if n > 1 and pos + n < self.end:
      return pos + n - 1
    return pos + n if n > 0 else pos + 1


def _segments(text: str, offsets: Sequence[int], run: Callable[[_Segment], None]) -> list[int]:
  fl, out, start = flags_of(text), [], 0
  for n in offsets:
    run(_Segment(text, fl, start, start + n, out))
    start += n
  return out


def split_gpt2(text: str, offsets: Sequence[int]) -> list[int]:
  """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""

  def run(s: _Segment) -> None:
    pos = s.ini
    while pos < s.end:
      k = _contraction(text, pos, s.end, fold=False)
      if k:
        pos += s.add(pos + k)
        continue
      space = text[pos] == " "
      f2 = s.f(pos + 1) if space else s.fl[pos]
      for cls in (LETTER, NUMBER):
        if f2 & cls:
          pos += space
          while s.f(pos) & cls:
            pos += 1
          s.add(pos)
          break
      else:
        if not f2 & (WHITESPACE | LETTER | NUMBER) and f2:
          pos = s.non_word(pos, WHITESPACE | LETTER | NUMBER)
        else:
          pos = s.whitespace(pos, newline_runs=False)
        s.add(pos)

  return _segments(text, offsets, run)


def _llama3_like(max_digits: int, marks: bool) -> Splitter:
  """llama3 (`\\p{N}{1,3}`), qwen2 (`\\p{N}`) and qwen35 (qwen2, letters take `\\p{M}`)."""
  word = LETTER | (MARK if marks else 0)
  other = WHITESPACE | word | NUMBER

  def split(text: str, offsets: Sequence[int]) -> list[int]:
    def run(s: _Segment) -> None:
      pos = s.ini
      while pos < s.end:
        k = _contraction(text, pos, s.end, fold=True)
        if k:
          pos += s.add(pos + k)
          continue
        c, f = text[pos], s.fl[pos]
        if not (c in "\r\n" or f & NUMBER) and (f & word or s.f(pos + 1) & word):
          pos += 1  # [^\r\n\p{L}\p{N}]?\p{L}+
          while s.f(pos) & word:
            pos += 1
          s.add(pos)
        elif f & NUMBER:  # \p{N}{1,max_digits}
          pos = s.digits(pos, max_digits)
        elif not (s.f(pos + 1) if c == " " else f) & other and f:
          s.add(s.newlines(s.non_word(pos, other)))  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
          pos = s.prev
        else:
          pos = s.whitespace(pos, newline_runs=True)
          s.add(pos)

    return _segments(text, offsets, run)

  return split


def is_han(ch: str) -> bool:
  """llama.cpp's `unicode_cpt_is_han`."""
  cp = ord(ch) if ch else -1
  return (
    0x4E00 <= cp <= 0x9FFF
    or 0x3400 <= cp <= 0x4DBF
    or 0x20000 <= cp <= 0x2EBEF
    or 0xF900 <= cp <= 0xFAFF
    or 0x2F800 <= cp <= 0x2FA1F
  )


def split_kimi_k2(text: str, offsets: Sequence[int]) -> list[int]:
  """Kimi-K2's patterns: `\\p{Han}+`, letter words (no Han) with contractions, then llama3's."""

  def letter(s: _Segment, pos: int) -> bool:
    return bool(s.f(pos) & LETTER) and not is_han(s.c(pos))

  def run(s: _Segment) -> None:
    pos = s.ini
    while pos < s.end:
      c, f = text[pos], s.fl[pos]
      if is_han(c):
        while is_han(s.c(pos)):
          pos += 1
        s.add(pos)
        continue
      lead = not (c in "\r\n" or f & (LETTER | NUMBER))
      if letter(s, pos) or (lead and letter(s, pos + 1)):
        pos += lead
        while letter(s, pos):
          pos += 1
        pos += _contraction(text, pos, s.end, fold=True) if pos < s.end else 0
        s.add(pos)
        continue
      if f & NUMBER:
        pos = s.digits(pos, 3)
        continue
      f2 = s.f(pos + 1) if c == " " else f
      if not f2 & (WHITESPACE | LETTER | NUMBER) and f2:
        pos = s.newlines(s.non_word(pos, WHITESPACE | LETTER | NUMBER))
      else:
        pos = s.whitespace(pos, newline_runs=True)
      s.add(pos)

  return _segments(text, offsets, run)


def split_digit_groups(text: str, offsets: Sequence[int]) -> list[int]:
  """AFMoE / tiny_aya: a run of digits in groups of 3 from the right; other text kept whole."""

  def run(s: _Segment) -> None:
    pos = s.ini
    while pos < s.end:
      if not s.fl[pos] & NUMBER:
        pos += 1
        continue
      first = pos
      while s.f(pos) & NUMBER:
        pos += 1
      cut = first + (pos - first) % 3
      if cut > first:
        s.add(cut)
      while cut < pos:
        cut += 3
        s.add(cut)
    s.add(s.end)

  return _segments(text, offsets, run)


def split_newlines(text: str, offsets: Sequence[int]) -> list[int]:
  """`[^\\n]+|[\\n]+`: runs of newlines and runs of anything else."""
  out, start = [], 0
  for n in offsets:
    pos, end = start, start + n
    while pos < end:
      nl, run_start = text[pos] == "\n", pos
      while pos < end and (text[pos] == "\n") == nl:
        pos += 1
      out.append(pos - run_start)
    start = end
  return out


_LLAMA3_CI = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _TAIL
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL
QWEN35 = (
  _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KIMI_K2 = r"\p{Han}+"
AFMOE_DIGITS = r"\p{AFMoE_digits}"
TINY_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
NEWLINES = r"[^\n]+|[\n]+"

CUSTOM: dict[str, Splitter] = {
  GPT2: split_gpt2,
  _LLAMA3_CI: _llama3_like(3, False),
  LLAMA3: _llama3_like(3, False),
  QWEN2: _llama3_like(1, False),
  QWEN35: _llama3_like(1, True),
  KIMI_K2: split_kimi_k2,
  AFMOE_DIGITS: split_digit_groups,
  TINY_AYA_DIGITS: split_digit_groups,
  NEWLINES: split_newlines,
}
"""Regex string -> the splitter llama.cpp runs for it (`unicode_regex_split_custom`)."""
