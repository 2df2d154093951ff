"""What the repack of GGUF tensors served as Q8_0 reads (a `GGUFCheckpoint`'s tensors, stacks
and fused groups): the file's own Q8_0 blocks; another type's own blocks, requantized in the
repack's own pass where `repack.requantizes_on_the_way` holds (the kernel layout, float16
scales, the native library); else Q8_0 blocks requantized first (`requant.q8_0_blocks`). And
the check that gives a requantized tensor's non-finite scale `q8_0_blocks`' error."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from q8rules.checkpoint.gguf import repack
from q8rules.checkpoint.gguf.header import Tensor
from q8rules.checkpoint.gguf.layouts import Q8_0, Layout
from q8rules.checkpoint.gguf.requant import q8_0_blocks
from q8rules.q8_0 import Q8Array


@dataclasses.dataclass(frozen=True)
class Sources:
  """The bytes a repack reads, one array a tensor; their byte order; and their GGML types where
  the repack requantizes them on the way (None: every array holds Q8_0 blocks)."""

  datas: list[np.ndarray]
  byteorder: str
  types: list[int] | None

  def checked(self, infos: Sequence[Tensor], value: Q8Array, path: Any) -> Q8Array:
    """`value`, repacked from these sources of `infos`, checked by `check_requantized` where the
    repack requantized them (blocks requantized before it were checked by `q8_0_blocks`)."""
    if self.types is not None:
      check_requantized(infos, value, path)
    return value


def check_requantized(infos: Sequence[Tensor], value: Q8Array, path: Any) -> None:
  """Nothing when `value`'s scales (repacked from `infos`, requantized on the way) are finite;
  else the error `q8_0_blocks` raises for the first requantized tensor that holds a non-finite
  value (a corrupt block), naming the file, the tensor and the row."""
  if np.isfinite(value.scale).all():
    return
  for t in infos:
    if t.tensor_type != Q8_0:
      q8_0_blocks(t, path=path)  # raises for the tensor that holds it
  # else the non-finite scales are the file's own Q8_0 blocks'


def q8_data(t: Tensor, byteorder: str, path: Any) -> tuple[np.ndarray, str]:
  """(Q8_0 blocks, their byte order) of a tensor served as Q8_0: the file's own blocks (in the
  file's `byteorder`), or the tensor requantized (`requant.q8_0_blocks`, little-endian)."""
  if t.tensor_type == Q8_0:
    return t.data, byteorder
  return q8_0_blocks(t, path=path), "<"


def sources(
  infos: Sequence[Tensor], *, layout: Layout, scale_dtype: Any, byteorder: str, path: Any
) -> Sources:
  """What the repack of the Q8_0-served tensors `infos` (from a file in `byteorder`) into
  `layout` reads: their own bytes and types where one is not Q8_0 and the repack requantizes
  them on the way (a little-endian file), else their Q8_0 blocks (in the order they share,
  else the file's)."""
  types = [int(t.tensor_type) for t in infos]
  if (
    any(t != Q8_0 for t in types)
    and byteorder == "<"
    and repack.requantizes_on_the_way(layout, scale_dtype, types)
  ):
    datas = [np.ascontiguousarray(t.data).reshape(-1).view(np.uint8) for t in infos]
    return Sources(datas, byteorder, types)
  blocks = [q8_data(t, byteorder, path) for t in infos]
  orders = {order for _, order in blocks}
  return Sources([b for b, _ in blocks], orders.pop() if len(orders) == 1 else byteorder, None)


__all__ = ["Sources", "check_requantized", "q8_data", "sources"]
