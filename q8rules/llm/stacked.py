"""A GGUF checkpoint seen as the scanned Transformer's params: one tensor per slot, stacked.

llama.cpp stores each block's tensors apart (`blk.0.attn_q.weight`, `blk.1.attn_q.weight`,
...); the scanned `Transformer` has one param per slot with a leading layer axis
(`layers/attn/q/kernel` of shape (layers, K, N)). `StackedTensors` is the mapping
`q8rules.checkpoint.assign` reads: a block tensor's slot is named by its param path and
its value stacks the file's per-layer tensors (Q8_0 stays Q8_0: int8 values and scales
stacked, never dequantised); a fused slot (`q8rules.llm.fuse`) concatenates its members'
stacks along N; every other tensor passes through under its own name. Each
file tensor's pages are released once read, so a load holds the params, not the params
and the mapped file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from q8rules.checkpoint import CheckpointError
from q8rules.llm.tensors import TensorSlot
from q8rules.q8_0 import Q8Array


def slot_name(path: tuple[str, ...]) -> str:
  """The name a stacked slot goes by in `StackedTensors`: its param path, '/'-joined."""
  return "/".join(path)


def _stack_specs(specs: list[Any]) -> Any:
  """The spec of the per-layer specs stacked along a new leading axis."""

  def stack(*leaves: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)

  return jax.tree.map(stack, *specs)


def _concat_specs(specs: list[Any]) -> Any:
  """The spec of the values `specs` concatenated along their last axis."""

  def concat(*leaves: Any) -> jax.ShapeDtypeStruct:
    n = sum(leaf.shape[-1] for leaf in leaves)
    return jax.ShapeDtypeStruct((*leaves[0].shape[:-1], n), leaves[0].dtype)

  return jax.tree.map(concat, *specs)


def _concat(parts: list[Any]) -> Any:
  """Stacked values (Q8Arrays or arrays) concatenated along their last (N) axis."""
  if isinstance(parts[0], Q8Array):
    return Q8Array(
      q=np.concatenate([p.q for p in parts], axis=-1),
      scale=np.concatenate([p.scale for p in parts], axis=-1),
      axis=parts[0].axis,
      dtype=parts[0].dtype,
    )
  return np.concatenate([np.asarray(p) for p in parts], axis=-1)


class StackedTensors(Mapping[str, Any]):
  """`ckpt`'s tensors with each scanned slot's per-layer tensors stacked under one name.

  Args:
    ckpt: a GGUF checkpoint (`spec`, `__getitem__`, `release`, `__iter__`).
    slots: GGUF name -> TensorSlot (`q8rules.llm.tensors.tensor_slots`); the block
      tensors of a scanned model (path under 'layers') are stacked in layer order.
    fused: a fused slot's name -> its members' slot names (`q8rules.llm.fuse.plan`): the
      members' stacks concatenated along the last (output, N) axis, in that order, go by
      the fused name instead of theirs (Q8_0 values and scales as they are).
  """

  def __init__(
    self,
    ckpt: Any,
    slots: Mapping[str, TensorSlot],
    fused: Mapping[str, tuple[str, ...]] | None = None,
  ):
    self._ckpt = ckpt
    self.path = ckpt.path
    groups: dict[tuple[str, ...], list[tuple[int, str]]] = {}
    for name, slot in slots.items():
      if slot.layer is not None and name in ckpt:
        groups.setdefault(slot.path, []).append((slot.layer, name))
    self._stacks = {
      slot_name(path): [name for _, name in sorted(members)]
      for path, members in groups.items()
      if path[0] == "layers"
    }
    stacked = {n for names in self._stacks.values() for n in names}
    self._fused = {
      name: [self._stacks[m] for m in members] for name, members in (fused or {}).items()
    }
    for members in (fused or {}).values():
      for m in members:
        self._stacks.pop(m, None)
    self._names = [n for n in ckpt if n not in stacked] + list(self._stacks) + list(self._fused)

  def name_map(self, slots: Mapping[str, TensorSlot]) -> dict[str, tuple[str, ...]]:
    """Name (as this mapping names it) -> param path, for `checkpoint.assign`."""
    out = {name: slot.path for name, slot in slots.items() if name in self._names}
    for name in (*self._stacks, *self._fused):
      out[name] = tuple(name.split("/"))
    return out

  def spec(self, name: str) -> Any:
    if name in self._fused:
      return _concat_specs([self._stack_spec(m) for m in self._fused[name]])
    members = self._stacks.get(name)
    if members is None:
      return self._ckpt.spec(name)
    return self._stack_spec(members)

  def _stack_spec(self, members: list[str]) -> Any:
    return _stack_specs([self._ckpt.spec(n) for n in members])

  def __getitem__(self, name: str) -> Any:
    if name in self._fused:
      groups = self._fused[name]
      get_fused = getattr(self._ckpt, "get_fused", None)  # one pass into the fused arrays
      value = get_fused(groups) if get_fused is not None else None
      if value is None:
        return _concat([self._stack(m) for m in groups])
      for n in (n for g in groups for n in g):
        self._ckpt.release(n)
      return value
    members = self._stacks.get(name)
    if members is None:
      value = self._ckpt[name]
      self._ckpt.release(name)
      return value
    return self._stack(members)

  def _stack(self, members: list[str]) -> Any:
    """The file tensors `members` stacked along a new leading axis (each released once read)."""
    get_stacked = getattr(self._ckpt, "get_stacked", None)  # one pass into the stacked arrays
    value = get_stacked(members) if get_stacked is not None else None
    if value is not None:
      for n in members:
        self._ckpt.release(n)
      return value
    parts = []
    for n in members:
      parts.append(self._ckpt[n])
      self._ckpt.release(n)
    if isinstance(parts[0], Q8Array):
      return Q8Array(
        q=np.stack([p.q for p in parts]),
        scale=np.stack([p.scale for p in parts]),
        axis=parts[0].axis,
        dtype=parts[0].dtype,
      )
    return np.stack([np.asarray(p) for p in parts])

  # ---- shard-wise reading (q8rules.checkpoint.shards; used by assign on a mesh) ----
  def read_region(self, name: str, index: Any) -> Any:
    """`self[name][index]`, reading only the region's bytes (a stack: its layers' regions)."""
    from q8rules.checkpoint.shards import read_stacked_region

    if name in self._fused:  # load_gguf fuses only off a mesh
      raise CheckpointError(f"{self.path}: {name!r} is fused at load; it is not read by region")
    return read_stacked_region(self._ckpt, self._stacks.get(name) or name, index)

  @property
  def bytes_read(self) -> int:
    """Bytes of tensor data read from the file so far (`GGUFCheckpoint.bytes_read`)."""
    return int(getattr(self._ckpt, "bytes_read", 0))

  # ----

  def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
    return (
      name in self._stacks or name in self._fused or (name in self._names and name in self._ckpt)
    )

  def __iter__(self) -> Iterator[str]:
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)


__all__ = ["StackedTensors", "slot_name"]
