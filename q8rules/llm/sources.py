"""Where each tensor of a loaded GGUF file lives in `GGUFModel.params`, and which file it was.

`load_gguf` reads tensor `blk.3.attn_k.weight` into a param: `layers/attn/k/kernel` at index 3
of its stacked layer axis (scanned blocks), or `layers_3/attn/k/kernel` (unrolled), or the
columns [Q, Q + K) of the fused `layers/attn/qkv/kernel` (q | k | v and gate | up fused at load,
`q8rules.llm.fuse`). `GGUFSource` keeps that map, with the file(s) and the options the params
were read with, so `q8rules.llm.save` can write the params back tensor by tensor in the file's
order and tell which ones still hold what the load gave.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint.gguf.read import GGUFCheckpoint
from q8rules.checkpoint.gguf.split import GGUFSplitCheckpoint
from q8rules.llm.stacked import slot_name
from q8rules.llm.tensors import TensorSlot


@dataclasses.dataclass(frozen=True)
class TensorSource:
  """One file tensor's place in the params.

  Attributes:
    path: its param's path as loaded (('layers', 'attn', 'qkv', 'kernel'); ('layers_3', ...)
      for an unrolled block).
    layer: its index along the param's leading (stacked layer) axis, or None (not stacked).
    columns: [start, stop) along the param's last axis (N, the output axis of a kernel in
      the kernel layout) for a member of a fused param, or None (the whole param).
    dense: whether it is a matrix the Q8 rules serve (a Dense kernel or the embedding table).
  """

  path: tuple[str, ...]
  layer: int | None = None
  columns: tuple[int, int] | None = None
  dense: bool = False

  def describe(self) -> str:
    """'layers/attn/qkv/kernel[3][..., 576:768]': the param and the part of it."""
    at = "" if self.layer is None else f"[{self.layer}]"
    cols = "" if self.columns is None else f"[..., {self.columns[0]}:{self.columns[1]}]"
    return "/".join(self.path) + at + cols


@dataclasses.dataclass(frozen=True)
class GGUFSource:
  """The GGUF file(s) a model was loaded from and where each of their tensors went.

  Attributes:
    path: the (first) file, as `load_gguf` was given it.
    files: (file, size in bytes, mtime in ns) of every file read (all parts of a split set):
      a file changed since the load is refused by `save_gguf` (its bytes are what it copies).
    dequantize_other: the load's `dequantize_other`.
    quantize: the load's `quantize`.
    tensors: GGUF name -> TensorSource, in the file's tensor order.
  """

  path: Path
  files: tuple[tuple[str, int, int], ...]
  dequantize_other: bool
  quantize: str | None
  tensors: dict[str, TensorSource]

  def check_files(self) -> None:
    """CheckpointError naming the file when one of `files` is gone or has changed since the
    load (size or modification time)."""
    for name, size, mtime in self.files:
      try:
        st = os.stat(name)
      except OSError as e:
        raise CheckpointError(f"{name}: the model's source file cannot be read: {e}") from None
      if (st.st_size, st.st_mtime_ns) != (size, mtime):
        raise CheckpointError(
          f"{name}: the model's source file has changed since it was loaded; its tensors"
          " cannot be copied from it (load the model again)"
        )


def file_stats(paths: list[Path]) -> tuple[tuple[str, int, int], ...]:
  """(path, size, mtime_ns) of each file."""
  out = []
  for p in paths:
    st = os.stat(p)
    out.append((str(p), st.st_size, st.st_mtime_ns))
  return tuple(out)


def tensor_sources(
  names: list[str],
  slots: Mapping[str, TensorSlot],
  fused: Mapping[str, tuple[str, ...]],
) -> dict[str, TensorSource]:
  """GGUF name -> TensorSource for the file's tensors `names` (in file order).

  Args:
    names: the file's tensors, in its order (every one a slot, `check_tensors` made sure, or one
      the model does not read, `tensors.skipped_tensors`: left out).
    slots: GGUF name -> TensorSlot of the unfused config (`tensor_slots`).
    fused: a fused slot name -> its members' slot names in output order (`Fusion.slots`).
  """
  widths: dict[str, int] = {}
  for slot in slots.values():
    # n_out of a kernel or of an expert stack [E, n_out, n_in]; the length of a bias
    widths[slot_name(slot.path)] = slot.shape[-2] if len(slot.shape) >= 2 else slot.shape[0]
  member_of: dict[str, tuple[tuple[str, ...], tuple[int, int]]] = {}
  for fused_name, members in fused.items():
    start = 0
    for m in members:
      member_of[m] = (tuple(fused_name.split("/")), (start, start + widths[m]))
      start += widths[m]
  out = {}
  for name in (n for n in names if n in slots):
    slot = slots[name]
    stacked = slot.path[0] == "layers" and slot.layer is not None
    path, columns = slot.path, None
    if stacked and slot_name(slot.path) in member_of:
      path, columns = member_of[slot_name(slot.path)]
    out[name] = TensorSource(path, slot.layer if stacked else None, columns, slot.dense)
  return out


def source_of(
  ckpt: GGUFCheckpoint | GGUFSplitCheckpoint,
  slots: Mapping[str, TensorSlot],
  fused: Mapping[str, Any],
) -> GGUFSource:
  """The `GGUFSource` of a model loaded from `ckpt` (a GGUFCheckpoint or a split set)."""
  parts = ckpt.parts
  policy = parts[0].policy
  return GGUFSource(
    path=Path(ckpt.path),
    files=file_stats([Path(p.path) for p in parts]),
    dequantize_other=policy.dequantize_other,
    quantize=policy.quantize,
    tensors=tensor_sources(list(ckpt), slots, fused),
  )


__all__ = ["GGUFSource", "TensorSource", "file_stats", "source_of", "tensor_sources"]
