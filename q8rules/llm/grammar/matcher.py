"""One row's grammar state: its next allowed tokens as a bitmask row, and the tokens it took."""

from __future__ import annotations

import numpy as np

from q8rules.llm.grammar.forms import Grammar
from q8rules.llm.grammar.vocab import ll_tokenizer
from q8rules.llm.tokenizer import GGUFTokenizer


class RowMatcher:
  """llguidance's matcher for one generated row.

  `fill(bitmask, row)` writes the tokens allowed next into `bitmask[row]` ((rows, words)
  int32, `q8rules.llm.grammar.words_for(vocab)` words); `advance(token)` takes the sampled
  token and says whether the grammar accepted it. `finished` is True once the grammar has
  nothing more to add (its only allowed token is EOS).
  """

  def __init__(self, grammar: Grammar, tokenizer: GGUFTokenizer):
    import llguidance

    self.grammar = grammar
    self.eos_id = tokenizer.eos_id
    self._matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar.text)
    if self._matcher.is_error():
      raise ValueError(f"{grammar.field}: {self._matcher.get_error()}")

  def fill(self, bitmask: np.ndarray, row: int) -> None:
    """Writes the allowed next tokens into `bitmask[row]` (int32, C-contiguous)."""
    from llguidance.numpy import fill_next_token_bitmask

    fill_next_token_bitmask(self._matcher, bitmask, row)

  def advance(self, token: int) -> bool:
    """Takes the sampled `token`; False if the grammar did not allow it (then the row's
    matcher is in error and `error` says why)."""
    return bool(self._matcher.consume_token(int(token)))

  @property
  def finished(self) -> bool:
    """Whether the grammar is complete and stopped (only EOS may follow)."""
    return bool(self._matcher.is_stopped() or self._matcher.is_accepting() and self._only_eos())

  def _only_eos(self) -> bool:
    words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return bool(bits.sum() == 1 and self.eos_id is not None and bits[self.eos_id])

  @property
  def error(self) -> str:
    return self._matcher.get_error() if self._matcher.is_error() else ""
