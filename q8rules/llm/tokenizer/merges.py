"""The pair-merging loop llama.cpp's SentencePiece and BPE tokenizers share.

Symbols start as the characters of a text; the adjacent pair with the smallest key
(BPE: merge rank; SentencePiece: minus the token's score), leftmost on ties, is
merged into its left symbol, and the loop goes on until no adjacent pair has a key.
A queued pair whose sides changed since is skipped, as llama.cpp skips it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


def merge_pairs(text: str, key: Callable[[str, str], float | None]) -> list[str]:
  """The symbols `text` ends as; key(left, right) is a pair's priority, None: no merge."""
  texts = list(text)
  n = len(texts)
  prev = list(range(-1, n - 1))
  nxt = [*range(1, n), -1]
  heap: list[tuple[float, int, int, str]] = []

  def push(left: int, right: int) -> None:
    if left >= 0 and right >= 0:
      k = key(texts[left], texts[right])
      if k is not None:
        heapq.heappush(heap, (k, left, right, texts[left] + texts[right]))

  for i in range(1, n):
    push(i - 1, i)
  while heap:
    _, left, right, joined = heapq.heappop(heap)
    if not texts[left] or not texts[right] or texts[left] + texts[right] != joined:
      continue  # outdated: one side was merged since
    texts[left], texts[right] = joined, ""
    nxt[left] = nxt[right]
    if nxt[right] >= 0:
      prev[nxt[right]] = left
    push(prev[left], left)
    push(left, nxt[left])
  return [t for t in texts if t]
