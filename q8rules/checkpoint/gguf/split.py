"""Split GGUF files (llama.cpp's `gguf-split`: `model-00001-of-00003.gguf`, ...) as one checkpoint.

Each part is a GGUF file with the keys `split.no` (0-based), `split.count` and
`split.tensors.count` (tensors in all parts); the first part carries the
model's metadata. `open_gguf(first_part)` opens every part (headers only, as
`load` does) and checks the set is whole before any tensor is read.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf.read import GGUFCheckpoint, load
from q8rules.checkpoint.gguf.requant import describe_requantized
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.checkpoint.reader import (
  CheckpointReader,
  Value,
  concat,
  concat_specs,
  stack_specs,
)
from q8rules.q8_0 import Q8Array

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""llama.cpp's split file names (`llama_split_prefix`)."""


class GGUFSplitCheckpoint(CheckpointReader):
  """The tensors of all parts of a split GGUF file by name (a lazy reader, like
  `GGUFCheckpoint`); metadata from the first part, without the `split.*` keys. Stacks and
  fused groups take each part's one-pass repack: each run of consecutive members that one
  part holds is repacked by that part, and the runs joined along the layer axis."""

  def __init__(self, parts: list[GGUFCheckpoint]):
    self.parts = parts
    self.path = parts[0].path
    self._owner: dict[str, GGUFCheckpoint] = {}
    for part in parts:
      for name in part:
        if name in self._owner:
          raise CheckpointError(f"{part.path}: tensor {name!r} is also in {self._owner[name].path}")
        self._owner[name] = part

  @property
  def metadata(self) -> dict[str, Any]:
    return {k: v for k, v in self.parts[0].metadata.items() if not k.startswith("split.")}

  @property
  def arch(self) -> str | None:
    return self.parts[0].arch

  def _part(self, name: str) -> GGUFCheckpoint:
    try:
      return self._owner[name]
    except KeyError:
      raise KeyError(f"{self.path}: no tensor {name!r} in its {len(self.parts)} parts") from None

  def __iter__(self) -> Iterator[str]:
    return iter(self._owner)

  def __len__(self) -> int:
    return len(self._owner)

  def __contains__(self, name: object) -> bool:
    return name in self._owner

  def __getitem__(self, name: str) -> Any:
    return self._part(name)[name]

  def get_tensor(self, name: str, **kw: Any) -> Any:
    return self._part(name).get_tensor(name, **kw)

  def spec(self, name: str, **kw: Any) -> Any:
    return self._part(name).spec(name, **kw)

  def tensor_type(self, name: str) -> Any:
    return self._part(name).tensor_type(name)

  def served_type(self, name: str) -> Any:
    return self._part(name).served_type(name)

  @property
  def requantized(self) -> Counter[str]:
    """How many tensors of each file type all parts serve as Q8_0 without being Q8_0."""
    return sum((p.requantized for p in self.parts), Counter())

  def describe_requantized(self) -> str:
    return describe_requantized(self.requantized)

  def gguf_shape(self, name: str) -> tuple[int, ...]:
    return self._part(name).gguf_shape(name)

  def raw(self, name: str) -> Any:
    return self._part(name).raw(name)

  def release(self, name: str) -> None:
    self._part(name).release(name)

  @property
  def bytes_read(self) -> int:
    """Bytes of tensor data copied out of all the parts so far."""
    return sum(p.bytes_read for p in self.parts)

  def read_region(self, name: str, index: Any, **kw: Any) -> Any:
    return self._part(name).read_region(name, index, **kw)

  def _runs(self, names: Sequence[str]) -> list[tuple[GGUFCheckpoint, list[str]]]:
    """`names` cut into runs of consecutive names that one part holds, with that part."""
    runs: list[tuple[GGUFCheckpoint, list[str]]] = []
    for name in names:
      part = self._part(name)
      if runs and runs[-1][0] is part:
        runs[-1][1].append(name)
      else:
        runs.append((part, [name]))
    return runs

  def _filled(self, spec: Any, fill: Any, ranges: list[tuple[int, int]]) -> Value:
    """A new stacked Q8Array of `spec` (64-byte aligned) whose layers [a, b) each part writes
    in place: `fill(a, b, view)` for each range."""
    out = Q8Array(
      q=aligned_empty(spec.q.shape, spec.q.dtype),
      scale=aligned_empty(spec.scale.shape, spec.scale.dtype),
      axis=spec.axis,
      dtype=spec.dtype,
    )
    for a, b in ranges:
      fill(a, b, Q8Array(q=out.q[a:b], scale=out.scale[a:b], axis=out.axis, dtype=out.dtype))
    return out

  def get_stacked(self, names: Sequence[str]) -> Value:
    runs = self._runs(names)
    if len(runs) == 1:
      return runs[0][0].get_stacked(names)
    specs = [self.spec(n) for n in names]
    if not all(isinstance(s, Q8Array) for s in specs) or len({s.q.shape for s in specs}) != 1:
      return concat([part.get_stacked(run) for part, run in runs], axis=0)
    bounds = list(itertools.accumulate([0, *(len(run) for _, run in runs)]))
    parts = {a: part for (part, _), a in zip(runs, bounds, strict=False)}
    return self._filled(
      stack_specs(specs),
      lambda a, b, view: parts[a].get_stacked(names[a:b], out=view),
      list(itertools.pairwise(bounds)),
    )

  def get_fused(self, groups: Sequence[Sequence[str]]) -> Value:
    """Per range of layers whose members one part holds, that part's one-pass fused repack
    into its layers of one new array (a layer's members in two parts: stacks joined)."""
    depth = len(groups[0]) if groups else 0
    if depth == 0 or any(len(g) != depth for g in groups):
      return super().get_fused(groups)
    owners = []
    for i in range(depth):
      parts = {id(self._part(g[i])): self._part(g[i]) for g in groups}
      if len(parts) != 1:
        return super().get_fused(groups)
      owners.append(next(iter(parts.values())))
    cuts = [0, *(i for i in range(1, depth) if owners[i] is not owners[i - 1]), depth]
    if len(cuts) == 2:
      return owners[0].get_fused(groups)
    specs = [stack_specs([self.spec(n) for n in g]) for g in groups]
    if not all(isinstance(s, Q8Array) for s in specs):
      return super().get_fused(groups)
    return self._filled(
      concat_specs(specs),
      lambda a, b, view: owners[a].get_fused([g[a:b] for g in groups], out=view),
      list(itertools.pairwise(cuts)),
    )

  def close(self) -> None:
    for part in self.parts:
      part.close()

  def __enter__(self) -> GGUFSplitCheckpoint:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def open_gguf(
  path: str | os.PathLike[str], **load_kwargs: Any
) -> GGUFCheckpoint | GGUFSplitCheckpoint:
  """Open a GGUF file, or every part of a split one given its first part.

  Args:
    path: a .gguf file; for a split set, any file named `*-00001-of-0000N.gguf`
      (or whose metadata has `split.count` > 1) opens all N parts.
    **load_kwargs: passed to `load` for each part.

  Raises:
    CheckpointError: a part missing (named), a part whose `split.no` or
      `split.count` disagrees with its name, a tensor in two parts, a tensor
      count different from `split.tensors.count`.
  """
  path = Path(path)
  first = load(path, **load_kwargs)
  count = int(first.metadata.get("split.count", 1))
  if count <= 1:
    return first
  m = SPLIT_NAME.match(path.name)
  if m is None or int(m["count"]) != count:
    first.close()
    raise CheckpointError(
      f"{path}: metadata says it is one of {count} split parts, but its name is not"
      f" '<name>-NNNNN-of-{count:05d}.gguf'"
    )
  names = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
  absent = [str(p) for p in names if not p.exists()]
  if absent:
    first.close()
    raise CheckpointError(
      f"{path}: split GGUF of {count} parts, {len(absent)} part(s) missing: {', '.join(absent)}"
    )
  parts = []
  try:
    for i, p in enumerate(names):
      part = first if p == path else load(p, **load_kwargs)
      parts.append(part)
      no, n = int(part.metadata.get("split.no", -1)), int(part.metadata.get("split.count", -1))
      if no != i or n != count:
        raise CheckpointError(
          f"{p}: split.no {no} of split.count {n}, but it is part {i} of {count} by its name"
        )
    merged = GGUFSplitCheckpoint(parts)
    total = first.metadata.get("split.tensors.count")
    if total is not None and int(total) != len(merged):
      raise CheckpointError(
        f"{path}: split.tensors.count is {total}, but the {count} parts hold {len(merged)} tensors"
      )
    return merged
  except BaseException:
    for part in parts:
      part.close()
    if first not in parts:
      first.close()
    raise
