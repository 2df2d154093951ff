"""The prefix cache: which prompt each slot's cache row still holds, and which slot a new
request should take to reuse the most of it.

A slot's row keeps what a prompt wrote after its request ends. What counts as held is a
prompt's start that its full chunks from position 0 wrote (`chunk` tokens each): a prompt that
reuses m of them (m a multiple of the chunk, at least one token left to prefill) is then
prefilled in the chunks a prompt with nothing cached runs past position m (the chunk plan of
n - m tokens is that of n past its first m), so its keys, values and tokens are the same bits
whether its prefix was cached or not. A reply's tokens (decoded one at a time) are never held.
"""

from __future__ import annotations

from collections.abc import Sequence


class PrefixCache:
  """What `slots` cache rows hold, in prompt ids.

  Args:
    slots: the runner's slots.
    chunk: the runner's prompt chunk.
    enabled: whether rows keep prefixes at all (`BatchRunner.keeps_prefixes`); when not,
      nothing is ever held.

  Attributes:
    held: per slot, the prompt ids its row holds as a prompt's full chunks wrote them.
    used: per slot, when a request last took it (a count of admissions).
  """

  def __init__(self, slots: int, chunk: int, enabled: bool):
    self.chunk = chunk
    self.enabled = enabled
    self.held: list[list[int]] = [[] for _ in range(slots)]
    self.used = [0] * slots
    self._taken = 0

  def clear(self) -> None:
    """Forget every held prefix (the next requests prefill from the start)."""
    self.held = [[] for _ in self.held]

  def reusable(self, ids: Sequence[int], slot: int) -> int:
    """How many of `ids`' first tokens slot `slot` holds for reuse: their common prefix with
    `held[slot]`, in whole chunks, leaving at least one token to prefill."""
    held = self.held[slot]
    n = min(len(held), len(ids) - 1)
    same = next((k for k in range(n) if held[k] != ids[k]), n)
    return same // self.chunk * self.chunk

  def choose(self, ids: Sequence[int], free: Sequence[int]) -> int:
    """The free slot for a prompt `ids`: the one holding the longest start of it; among
    equals, the one used least recently (what it holds is the least likely to be asked for
    again), then the lowest."""
    return max(free, key=lambda i: (self.reusable(ids, i), -self.used[i], -i))

  def take(self, ids: Sequence[int], slot: int) -> int:
    """A request with prompt `ids` takes `slot`: the tokens it reuses (its prefill starts
    there); the slot holds those alone until its chunks are written."""
    self._taken += 1
    self.used[slot] = self._taken
    reused = self.reusable(ids, slot)
    self.held[slot] = list(ids[:reused])
    return reused

  def wrote(self, ids: Sequence[int], slot: int, start: int, length: int) -> None:
    """The chunk of `ids` at [start, start + length) was prefilled into `slot`: a full chunk
    right after what the slot holds is held too."""
    if self.enabled and length == self.chunk and len(self.held[slot]) == start:
      self.held[slot] = list(ids[: start + length])


__all__ = ["PrefixCache"]
