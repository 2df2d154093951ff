"""Rows whose tokens a grammar constrains: each one's mask before a step, its token after.

A `Request` may carry a `grammar`: an object with `fill(bitmask, row)` (writes the tokens it
allows next into row `row` of a (rows, words) int32 packed bitmask, `q8rules.engine.bitmask`)
and `advance(token) -> bool` (takes the sampled token; False if it does not fit), as
`q8rules.llm.grammar.RowMatcher` has. The scheduler then:

- samples the request's first token (its prompt's last chunk) among the grammar's first tokens;
- while such a row decodes, runs one decode step a program and hands out every token before
  the next step starts (the next mask depends on it), giving each constrained row its mask
  before the step; free rows decode beside it with every bit set (the same tokens as alone);
- hands each token to the grammar: one it refuses ends that request with an error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from q8rules.engine.bitmask import words_for


class GrammarRefused(RuntimeError):
  """A sampled token the request's grammar did not take (the mask should have prevented it)."""


def first_mask(grammar: Any, vocab: int) -> np.ndarray | None:
  """The (words,) int32 mask of the tokens `grammar` allows first, or None without one."""
  if grammar is None:
    return None
  bits = np.zeros((1, words_for(vocab)), np.int32)
  grammar.fill(bits, 0)
  return bits[0]


def constrained(rows: list[tuple[int, Any]]) -> bool:
  """Whether any of the (slot, request) `rows` has a grammar."""
  return any(r.grammar is not None for _, r in rows)


def set_masks(runner: Any, rows: list[tuple[int, Any]]) -> None:
  """Each constrained row of `rows` (slot, request) gets its grammar's next mask in `runner`."""
  for slot, r in rows:
    if r.grammar is not None:
      runner.set_allowed(slot, first_mask(r.grammar, runner.vocab))


def take(r: Any, token: int) -> None:
  """Request `r`'s grammar (if any) takes `token`.

  Raises:
    GrammarRefused: the grammar refused it."""
  if r.grammar is not None and not r.grammar.advance(token):
    error = getattr(r.grammar, "error", "")
    raise GrammarRefused(f"token {token} does not fit the request's grammar {error}".rstrip())
