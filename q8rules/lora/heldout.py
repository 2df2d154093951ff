"""The held-out part of a fine-tuning text: which tokens the evaluation reads and training never
does, and the evaluation's batches.

A plain text (one token stream of n tokens) holds out `round(fraction * n)` tokens as k
contiguous windows of at most `length` tokens each, spread evenly over the text (so the
evaluation reads every part of it, not only its end); training draws its windows from the rest
and never across a held-out window (`text_windows(..., exclude=spans)`). Chat data holds out
whole conversations. The evaluation reads its windows in order, every token once, as batches
of (tokens (B, T) int32, mask (B, T) bool) padded with masked rows and positions.

Held out is not unseen when the text repeats itself: a held-out token inside `GRAM` tokens in a
row that training also reads (a paragraph said twice, a refrain, a licence at every chapter) is
predicted from memory, and the eval loss falls while the adapter learns the text by heart.
`repeats_training` finds those tokens; the evaluation leaves them out and says how many.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

Batch = tuple[np.ndarray, np.ndarray]
Span = tuple[int, int]
T = TypeVar("T")


def held_out_spans(n: int, fraction: float, length: int) -> list[Span]:
  """The [start, stop) spans a text of `n` tokens holds out: `round(fraction * n)` tokens (at
  least 2 when the fraction is > 0) in `ceil(held / length)` windows of equal size spread evenly
  over the text. [] for fraction 0.

  Raises:
    ValueError: a fraction outside [0, 0.5], or a text too short to hold out 2 tokens and keep 2.
  """
  if not 0 <= fraction <= 0.5:
    raise ValueError(f"the held-out fraction must lie in [0, 0.5], got {fraction}")
  if fraction == 0:
    return []
  held = max(2, round(fraction * n))
  if n - held < 2:
    raise ValueError(f"a text of {n} tokens is too short to hold out {held} of them")
  k = math.ceil(held / length)
  size = held // k
  starts = [int((i + 0.5) * n / k - size / 2) for i in range(k)]
  return [(s, s + size) for s in starts]


def train_starts(n: int, length: int, exclude: Sequence[Span]) -> np.ndarray:
  """The starts s (int64) of the windows [s, s + length) of a text of `n` tokens that overlap
  no span of `exclude`."""
  held = np.zeros(n + 1, np.int64)
  for start, stop in exclude:
    held[start + 1 : stop + 1] = 1
  inside = np.cumsum(held)  # inside[i]: held-out tokens among the first i
  starts = np.arange(n - length + 1)
  return starts[inside[starts + length] == inside[starts]]


def longest_gap(n: int, exclude: Sequence[Span]) -> int:
  """The most tokens in a row a text of `n` tokens keeps between (and around) the spans."""
  edges = [0, *[x for span in sorted(exclude) for x in span], n]
  return max(edges[i + 1] - edges[i] for i in range(0, len(edges), 2))


def split_items(items: Sequence[T], fraction: float) -> tuple[list[T], list[T]]:
  """(train, held out): every `round(1 / fraction)`-th item held out (at least one, and never
  all), spread over the list as the text's windows are. [] held out for fraction 0 or one item.
  """
  if fraction <= 0 or len(items) < 2:
    return list(items), []
  held_n = min(len(items) - 1, max(1, round(fraction * len(items))))
  picked = {int((i + 0.5) * len(items) / held_n) for i in range(held_n)}
  return (
    [x for i, x in enumerate(items) if i not in picked],
    [x for i, x in enumerate(items) if i in picked],
  )


GRAM = 13
"""Tokens in a row that make a verbatim repeat: the n-gram GPT-3's paper used to find test text
in its training data (Brown et al. 2020, appendix C)."""


def _gram_hashes(ids: np.ndarray, gram: int) -> np.ndarray:
  """A 64-bit polynomial hash (uint64) of each window ids[p : p + gram], p in [0, n - gram]."""
  n = len(ids) - gram + 1
  h = np.zeros(max(n, 0), np.uint64)
  if n <= 0:
    return h
  base = np.uint64(0x100000001B3)
  with np.errstate(over="ignore"):
    for i in range(gram):
      h = h * base + ids[i : i + n].astype(np.uint64) + np.uint64(1)
  return h


def repeats_training(held: Any, training: Sequence[Any], gram: int = GRAM) -> np.ndarray:
  """Which tokens of the held-out stream `held` ((t,) ids) lie inside `gram` tokens in a row
  that also stand, in the same order, in one of the `training` streams: (t,) bool."""
  held = np.asarray(held, np.int64)
  out = np.zeros(len(held), bool)
  seen = [_gram_hashes(np.asarray(t, np.int64), gram) for t in training]
  seen = np.concatenate(seen) if seen else np.zeros(0, np.uint64)
  if len(held) < gram or not len(seen):
    return out
  for p in np.flatnonzero(np.isin(_gram_hashes(held, gram), seen)):
    out[p : p + gram] = True
  return out


def training_streams(ids: Any, spans: Sequence[Span]) -> list[np.ndarray]:
  """The parts of the stream `ids` that training reads: the tokens between (and around) the
  held-out `spans`."""
  ids = np.asarray(ids)
  edges = [0, *[x for span in sorted(spans) for x in span], len(ids)]
  return [ids[edges[i] : edges[i + 1]] for i in range(0, len(edges), 2)]


def without_repeats(rows: Sequence[Batch], training: Sequence[Any]) -> tuple[list[Batch], int]:
  """`rows` with the mask cleared where a row's tokens repeat the `training` streams verbatim
  (`repeats_training`), and how many of the loss's tokens (`targets`' count) that drops."""
  out, dropped = [], 0
  for tokens, mask in rows:
    mask = np.asarray(mask, bool)
    keep = mask & ~repeats_training(tokens, training)
    dropped += int(mask[1:].sum() - keep[1:].sum())
    out.append((tokens, keep))
  return out, dropped


def text_rows(ids: Any, spans: Sequence[Span]) -> list[Batch]:
  """The rows of the held-out spans of the stream `ids`: (tokens (t,), mask (t,) all set)."""
  ids = np.asarray(ids, np.int32)
  return [(ids[a:b], np.ones(b - a, bool)) for a, b in spans]


def windows_of(ids: Any, length: int) -> list[Span]:
  """A whole text cut into windows of `length` tokens, in order (the last one shorter, when it
  has 2 tokens or more): every token read once."""
  n = len(ids)
  return [(a, min(a + length, n)) for a in range(0, n, length) if min(a + length, n) - a >= 2]


def eval_batches(rows: Sequence[Batch], batch: int, length: int) -> list[Batch]:
  """`rows` ((tokens (t,), mask (t,)) each, t <= `length`) as batches of (tokens (batch, T)
  int32, mask (batch, T) bool), T the longest row: short rows padded with token 0 and a clear
  mask, the last batch with empty rows, so one program evaluates them all."""
  width = min(length, max(len(t) for t, _ in rows))
  out = []
  for first in range(0, len(rows), batch):
    tokens = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), bool)
    for r, (t, m) in enumerate(rows[first : first + batch]):
      tokens[r, : len(t[:width])], mask[r, : len(m[:width])] = t[:width], m[:width]
    out.append((tokens, mask))
  return out


def targets(batches: Sequence[Batch]) -> int:
  """The tokens the loss of `batches` counts: set mask positions after the first of each row."""
  return int(sum(np.asarray(m)[:, 1:].sum() for _, m in batches))


__all__ = [
  "GRAM",
  "eval_batches",
  "held_out_spans",
  "longest_gap",
  "repeats_training",
  "split_items",
  "targets",
  "text_rows",
  "train_starts",
  "training_streams",
  "windows_of",
  "without_repeats",
]
