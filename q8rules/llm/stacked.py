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

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint.reader import CheckpointReader, concat_specs, stack_specs
from q8rules.llm.tensors import TensorSlot


def slot_name(path: tuple[str, ...]) -> str:
  """The name a stacked slot goes by in `StackedTensors`: its param path, '/'-joined."""
  return "/".join(path)


class StackedTensors(CheckpointReader):
  """`ckpt`'s tensors with each scanned slot's per-layer tensors stacked under one name.

  Args:
    ckpt: the file's reader (a `CheckpointReader`: one GGUF file or a split set).
    slots: GGUF name -> TensorSlot (`q8rules.llm.tensors.tensor_slots`); the block
      tensors of a scanned model (path under 'layers') are stacked in layer order.
    fused: a fused slot's name -> its members' slot names (`q8rules.llm.fuse.plan`): the
      members' stacks concatenated along the last (output, N) axis, in that order, go by
      the fused name instead of theirs (Q8_0 values and scales as they are).
  """

  def __init__(
    self,
    ckpt: CheckpointReader,
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
    # a tensor of no slot is one the model does not read (`tensors.skipped_tensors`)
    unstacked = [n for n in ckpt if n not in stacked and n in slots]
    self._names = unstacked + list(self._stacks) + list(self._fused)

  def name_map(self, slots: Mapping[str, TensorSlot]) -> dict[str, tuple[str, ...]]:
    """Name (as this mapping names it) -> param path, for `checkpoint.assign`."""
    out = {name: slot.path for name, slot in slots.items() if name in self._names}
    for name in (*self._stacks, *self._fused):
      out[name] = tuple(name.split("/"))
    return out

  def spec(self, name: str) -> Any:
    if name in self._fused:
      return concat_specs([self._stack_spec(m) for m in self._fused[name]])
    members = self._stacks.get(name)
    if members is None:
      return self._ckpt.spec(name)
    return self._stack_spec(members)

  def _stack_spec(self, members: list[str]) -> Any:
    return stack_specs([self._ckpt.spec(n) for n in members])

  def get_tensor(self, name: str) -> Any:
    """A fused slot (one pass into the fused arrays), a stack (one pass into the stacked
    arrays) or a file tensor; each file tensor released once read."""
    if name in self._fused:
      groups = self._fused[name]
      value = self._ckpt.get_fused(groups)
      members = [n for g in groups for n in g]
    elif name in self._stacks:
      members = self._stacks[name]
      value = self._ckpt.get_stacked(members)
    else:
      members = [name]
      value = self._ckpt[name]
    for n in members:
      self._ckpt.release(n)
    return value

  # ---- shard-wise reading (q8rules.checkpoint.shards; used by assign on a mesh) ----
  def read_region(self, name: str, index: Any) -> Any:
    """`self[name][index]`, reading only the region's bytes (a stack: its layers' regions)."""
    from q8rules.checkpoint.shards import read_stacked_region

    if name in self._fused:  # load_gguf fuses only off a mesh
      raise CheckpointError(f"{self.path}: {name!r} is fused at load; it is not read by region")
    return read_stacked_region(self._ckpt, self._stacks.get(name) or name, index)

  @property
  def bytes_read(self) -> int:
    """Bytes of tensor data read from the file so far (the reader's `bytes_read`)."""
    return self._ckpt.bytes_read

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
