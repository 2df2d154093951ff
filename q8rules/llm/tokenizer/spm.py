"""llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm_session`).

The text (spaces already U+2581) is split into characters; the adjacent pair whose
concatenation is a token with the highest score is merged, leftmost first on ties,
until no pair forms a token (merges.py; llama.cpp skips a stale pair by its byte size,
merges.py by its text: the same pairs, as a symbol only grows). A character that is
not a token becomes its bytes' tokens ('<0xXX>', byte fallback). llama.cpp's `resegment` also looks merged
pieces up in `rev_merge`; a merged piece is always a token, so that never runs
and is left out here.
"""

from __future__ import annotations

from q8rules.llm.tokenizer.merges import merge_pairs
from q8rules.llm.tokenizer.vocab import Vocab


def tokenize(vocab: Vocab, text: str, out: list[int]) -> None:
  """Append the ids of `text` (one fragment, spaces escaped) to `out`."""
  t2id, scores = vocab.token_to_id, vocab.scores

  def key(left: str, right: str) -> float | None:
    tid = t2id.get(left + right)
    return None if tid is None else -scores[tid]

  for piece in merge_pairs(text, key):
    tid = t2id.get(piece)
    if tid is not None:
      out.append(tid)
    else:
      out.extend(vocab.byte_token(b) for b in piece.encode("utf-8"))
