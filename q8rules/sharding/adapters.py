"""LoRA adapters' specs: they follow the split of their frozen Q8_0 base's (K, N) matrix.

Here, below `q8rules.lora`, because placing a param tree (`q8rules.sharding.params`) gives an
adapter param its base's split as the LoRA provider does.

A base param `<name>` (Q8 values (..., K, N)) has its adapters `<name>_lora_a` (..., K, rank) and
`<name>_lora_b` (..., rank, N) beside it (`q8rules.Q8LoraProvider`). A column-parallel base
(N split) gives B the N split and leaves A whole; a row-parallel base (K split) gives A the K
split and leaves B whole. The rank axis is never split; leading (stacked-layer) axes keep the
base's entries. Then x @ A @ B splits as the base's own product does: column-parallel, its
output is split along N like the base's; row-parallel, x @ A is a (rows, rank) partial sum.
"""

from __future__ import annotations

from typing import Any, Literal

from jax.sharding import PartitionSpec as P

LORA_A, LORA_B = "_lora_a", "_lora_b"
"""The suffixes of the adapter params' names ('kernel' -> 'kernel_lora_a', 'kernel_lora_b')."""

Which = Literal["a", "b"]


def adapter_of(name: str) -> tuple[str, Which] | None:
  """('kernel', 'a') for 'kernel_lora_a', ('kernel', 'b') for 'kernel_lora_b', else None."""
  for suffix, which in ((LORA_A, "a"), (LORA_B, "b")):
    if name.endswith(suffix) and len(name) > len(suffix):
      return name[: -len(suffix)], which
  return None


def adapter_entries(base: Any, which: Which, ndim: int = 2) -> tuple[Any, ...]:
  """The spec entries of adapter A (`which='a'`) or B ('b') from its base's.

  Args:
    base: the spec (a PartitionSpec, tuple or list of entries) of the base's Q8 values
      (..., K, N), padded with None to `ndim` entries.
    which: 'a' (A: (..., K, rank), K's entry) or 'b' (B: (..., rank, N), N's entry).
    ndim: the rank of the Q8 values (2, more with stacked layers).

  Returns:
    A tuple of `ndim` entries (the leading ones the base's).
  """
  entries = tuple(P(*base))
  if len(entries) > ndim:
    raise ValueError(
      f"the base of a LoRA adapter: {P(*base)} has {len(entries)} entries for {ndim} axes"
    )
  *lead, k, n = entries + (None,) * (ndim - len(entries))
  return (*lead, k, None) if which == "a" else (*lead, None, n)


def adapter_spec(base: Any, which: Which, ndim: int = 2) -> P:
  """`adapter_entries` as a PartitionSpec."""
  return P(*adapter_entries(base, which, ndim))


__all__ = ["LORA_A", "LORA_B", "adapter_entries", "adapter_of", "adapter_spec"]
