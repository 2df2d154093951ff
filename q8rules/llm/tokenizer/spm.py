"""llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm_session`).

The text (spaces already U+2581) is split into characters; the adjacent pair whose
concatenation is a token with the highest score is merged, leftmost first on ties,
until no pair forms a token. A character that is not a token becomes its bytes'
tokens ('<0xXX>', byte fallback). llama.cpp's `resegment` also looks merged
pieces up in `rev_merge`; a merged piece is always a token, so that never runs
and is left out here.
"""

from __future__ import annotations

import heapq

from q8rules.llm.tokenizer.vocab import Vocab


def tokenize(vocab: Vocab, text: str, out: list[int]) -> None:
  """Append the ids of `text` (one fragment, spaces escaped) to `out`."""
  t2id, scores = vocab.token_to_id, vocab.scores
  texts = list(text)
  n = len(texts)
  prev = list(range(-1, n - 1))
  nxt = [*range(1, n), -1]
  heap: list[tuple[float, int, int, int]] = []

  def push(left: int, right: int) -> None:
    if left >= 0 and right >= 0:
      joined = texts[left] + texts[right]
      tid = t2id.get(joined)
      if tid is not None:
        heapq.heappush(heap, (-scores[tid], left, right, len(joined)))

  for i in range(1, n):
    push(i - 1, i)
  while heap:
    _, left, right, size = heapq.heappop(heap)
    if not texts[left] or not texts[right] or len(texts[left]) + len(texts[right]) != size:
      continue  # outdated: one side was merged since
    texts[left], texts[right] = texts[left] + texts[right], ""
    nxt[left] = nxt[right]
    if nxt[right] >= 0:
      prev[nxt[right]] = left
    push(prev[left], left)
    push(left, nxt[left])
  for piece in texts:
    if not piece:
      continue
    tid = t2id.get(piece)
    if tid is not None:
      out.append(tid)
    else:
      out.extend(vocab.byte_token(b) for b in piece.encode("utf-8"))
