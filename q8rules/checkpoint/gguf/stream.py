"""A stack (or a fused group of stacks) of GGUF tensors repacked run by run: the stack's
matrices (each layer's tensor, or each expert of a layer's (E, N, K) tensor) walked in file
order in runs of about `STREAM_BYTES` of the file, each run repacked straight into its place in
the stacked arrays and its file pages released before the next is read. A load then holds the
params and one run of the mapped file, never the params and a whole stack's pages (an expert
stack of Qwen3-30B-A3B's shapes is 1.7 GB a slot over 8 layers)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from q8rules.checkpoint.gguf import repack
from q8rules.checkpoint.gguf.header import Tensor
from q8rules.checkpoint.gguf.layouts import Q8_0, Layout, q8_shapes
from q8rules.checkpoint.gguf.repack_sources import Sources, check_requantized
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.q8_0 import BLOCK, Q8Array

STREAM_BYTES = 64 << 20
"""File bytes a run reads (whole matrices; at least one): the most of a stack's file pages a
load holds at once."""


def matrices(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
  """(one matrix's shape, how many) of a tensor of numpy shape `shape`: its last two axes, as
  many as its leading axes hold (an (E, N, K) expert stack: E matrices (N, K)); a vector is
  one."""
  if len(shape) < 2:
    return shape, 1
  return shape[-2:], math.prod(shape[:-2])


def outputs(
  out: Q8Array | None, q_shape: tuple[int, ...], scale_shape: tuple[int, ...], scale_dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
  """(q, scale) to write a stack into: `out`'s (checked: C-contiguous, of these shapes and the
  scale dtype), else new arrays on a 64-byte boundary (`host_buffers`)."""
  if out is None:
    return aligned_empty(q_shape, np.int8), aligned_empty(scale_shape, scale_dtype)
  q, scale = out.q, out.scale
  if (
    q.shape != q_shape
    or scale.shape != scale_shape
    or scale.dtype != np.dtype(scale_dtype)
    or not (q.flags.c_contiguous and scale.flags.c_contiguous)
  ):
    raise ValueError(
      f"out is q {q.shape}, scale {scale.dtype}{scale.shape}; expected C-contiguous"
      f" {q_shape} and {np.dtype(scale_dtype)}{scale_shape}"
    )
  return q, scale


@dataclasses.dataclass
class Run:
  """Matrices [start, stop) of a stack (layer-major: layer i's matrix e is i * per_layer + e),
  of every member of a fused group.

  Attributes:
    start, stop: the run's matrices.
    datas: member j's matrices' bytes (what the repack reads: the file's Q8_0 blocks, another
      type's own blocks, or blocks requantized first), one array a matrix.
    types: member j's matrices' GGML types as the repack reads them (Q8_0 for Q8_0 blocks;
      another type is requantized in the repack's pass).
    byteorder: the byte order the run's blocks are in.
    tensors: the tensors the run reads from, by name (for `check`).
    ranges: the file byte ranges the run reads.
  """

  start: int
  stop: int
  datas: list[list[np.ndarray]]
  types: list[list[int]]
  byteorder: str
  tensors: dict[str, Tensor] = dataclasses.field(default_factory=dict)
  ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)

  def source_types(self, j: int) -> list[int] | None:
    """Member j's types as the repack takes them (None: all Q8_0)."""
    types = self.types[j]
    return None if all(t == Q8_0 for t in types) else types

  def check(self, value: Q8Array, path: Any) -> None:
    """`check_requantized` of the run's repacked `value` where the repack requantized some."""
    if any(self.source_types(j) is not None for j in range(len(self.types))):
      check_requantized(list(self.tensors.values()), value, path)


def runs(
  groups: Sequence[Sequence[Tensor]],
  per_layer: int,
  sources: Callable[[Tensor], Sources],
  release: Callable[[int, int], None],
  run_bytes: int | None = None,
) -> Iterator[Run]:
  """The runs of the stacks `groups` (member j's tensor of layer i: `groups[j][i]`, each holding
  `per_layer` matrices), in file order: each run about `run_bytes` of the file (whole matrices
  of every member; a change of byte order ends one). Once the caller is done with a run (the
  generator resumes) its file bytes are released: `release(start, end)` of each byte range.
  `run_bytes` None: `STREAM_BYTES`.

  `sources(t)` gives what the repack of tensor t reads; it is asked once a tensor.
  """
  run_bytes = STREAM_BYTES if run_bytes is None else run_bytes
  members = len(groups)
  run: Run | None = None
  size = 0
  for i in range(len(groups[0])):
    tensors = [g[i] for g in groups]
    srcs = [sources(t) for t in tensors]
    if run is not None and any(s.byteorder != run.byteorder for s in srcs):
      yield run
      _release(run, release)
      run = None
    flat = [s.datas[0].reshape(-1) for s in srcs]
    for e in range(per_layer):
      if run is None:
        start = i * per_layer + e
        empty: list[list[Any]] = [[] for _ in range(members)]
        run = Run(start, start, empty, [[] for _ in range(members)], srcs[0].byteorder)
        size = 0
      for j, (t, s, data) in enumerate(zip(tensors, srcs, flat, strict=True)):
        step = data.size // per_layer
        run.datas[j].append(data[e * step : (e + 1) * step])
        run.types[j].append(Q8_0 if s.types is None else int(s.types[0]))
        file_step = t.data.nbytes // per_layer
        run.ranges.append((t.data_offset + e * file_step, t.data_offset + (e + 1) * file_step))
        run.tensors[t.name] = t
        size += file_step
      run.stop += 1
      if size >= run_bytes:
        yield run
        _release(run, release)
        run = None
  if run is not None:
    yield run
    _release(run, release)


@dataclasses.dataclass(frozen=True)
class Repacking:
  """What `stack` and `fuse` repack with: a checkpoint's layout, scale dtype and Q8Array dtype,
  what the repack of a tensor reads (`sources`), how file bytes are released (`release(start,
  end)`) and the file (for messages)."""

  layout: Layout
  scale_dtype: np.dtype
  dtype: np.dtype
  sources: Callable[[Tensor], Sources]
  release: Callable[[int, int], None]
  path: Any


def stack(
  infos: Sequence[Tensor], shape: tuple[int, ...], out: Q8Array | None, how: Repacking
) -> Q8Array:
  """Q8_0-served tensors of numpy shape `shape` (`[*lead, n_out, n_in]`) stacked along a new
  leading axis in `how.layout`, run by run (`runs`), into `out` where given (C-contiguous, e.g.
  layers [a, b) of a larger stack)."""
  n = len(infos)
  q_shape, scale_shape, axis = q8_shapes(shape, how.layout)
  q, scale = outputs(out, (n, *q_shape), (n, *scale_shape), how.scale_dtype)
  m_shape, per_layer = matrices(shape)
  q_m, scale_m, _ = q8_shapes(m_shape, how.layout)
  q_flat = q.reshape(n * per_layer, *q_m)  # views: q and scale are C-contiguous
  scale_flat = scale.reshape(n * per_layer, *scale_m)
  for run in runs([infos], per_layer, how.sources, how.release):
    into = Q8Array(q=q_flat[run.start : run.stop], scale=scale_flat[run.start : run.stop])
    part = repack.repack_q8_layers(
      run.datas[0], m_shape, run.byteorder, how.scale_dtype, how.layout, how.dtype, into,
      run.source_types(0),
    )  # fmt: skip
    run.check(part, how.path)
  return Q8Array(q=q, scale=scale, axis=axis, dtype=how.dtype)


def fuse(
  infos: Sequence[Sequence[Tensor]],
  rows: Sequence[int],
  lead: tuple[int, ...],
  n: int,
  out: Q8Array | None,
  how: Repacking,
) -> Q8Array:
  """Member j's per-layer tensors (`infos[j]`, each `[*lead, rows[j], n]` in numpy order) fused
  along N in the kernel layout, run by run: q (layers, *lead, n, sum(rows)) int8, scale
  (layers, *lead, n/32, sum(rows)); each matrix's members side by side, member j in columns
  [sum(rows[:j]), sum(rows[:j + 1])). Into `out` where given (C-contiguous)."""
  layers, width, per_layer = len(infos[0]), sum(rows), math.prod(lead)
  q, scale = outputs(
    out, (layers, *lead, n, width), (layers, *lead, n // BLOCK, width), how.scale_dtype
  )
  q_flat = q.reshape(layers * per_layer, n, width)  # views: q and scale are C-contiguous
  scale_flat = scale.reshape(layers * per_layer, n // BLOCK, width)
  for run in runs(infos, per_layer, how.sources, how.release):
    into = Q8Array(q=q_flat[run.start : run.stop], scale=scale_flat[run.start : run.stop])
    types = [run.source_types(j) for j in range(len(infos))]
    part = repack.repack_q8_fused(
      run.datas, rows, n, run.byteorder, how.scale_dtype, how.dtype, into, types
    )
    run.check(part, how.path)
  axis = q8_shapes((*lead, width, n), "kernel")[2]  # one layer's blocked axis, as `stack`'s
  return Q8Array(q=q, scale=scale, axis=axis, dtype=how.dtype)


def _release(run: Run, release: Callable[[int, int], None]) -> None:
  """Release `run`'s file bytes, adjacent ranges merged."""
  merged: list[list[int]] = []
  for a, b in sorted(run.ranges):
    if merged and merged[-1][1] == a:
      merged[-1][1] = b
    else:
      merged.append([a, b])
  for a, b in merged:
    release(a, b)


__all__ = ["STREAM_BYTES", "Repacking", "Run", "fuse", "matrices", "outputs", "runs", "stack"]
