"""Q8_0 tensors' 34-byte blocks repacked into `Q8Array`s without dequantising: one tensor, a
stack of one shape, or the members of a fused slot straight into their columns (in the kernel
layout on a host where the native library runs: read and transposed in one pass). There,
tensors of another type are requantized to Q8_0 in the same pass (`requantizes_on_the_way`):
their Q8_0 blocks are never made whole."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.checkpoint.gguf.layouts import Q8_0, Layout, block_dtype, q8_shapes
from q8rules.checkpoint.gguf.requant_native import block_of, requant_native_types
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.kernels.native import repack as native_repack
from q8rules.q8_0 import BLOCK, Q8Array


@jax.jit
def _transpose_last_two(a: jax.Array) -> jax.Array:
  """(..., R, C) -> (..., C, R) on the default device."""
  return jnp.swapaxes(a, -1, -2)


def repack_q8(
  data: np.ndarray,
  shape: tuple[int, ...],
  byteorder: str,
  scale_dtype: np.dtype,
  layout: Layout,
  dtype: np.dtype,
  source_types: Sequence[int] | None = None,
) -> Q8Array:
  """34-byte blocks (the file's bytes) into a Q8Array, one copy each of q and d.

  data: uint8, the tensor's bytes; shape: numpy order `[*lead, n_out, n_in]`;
  `source_types`: as `repack_q8_layers` takes them (its one tensor's type).
  """
  out = repack_q8_layers(
    [data], shape, byteorder, scale_dtype, layout, dtype, source_types=source_types
  )
  return dataclasses.replace(out, q=out.q[0], scale=out.scale[0])


def repack_q8_layers(
  datas: Sequence[np.ndarray],
  shape: tuple[int, ...],
  byteorder: str,
  scale_dtype: np.dtype,
  layout: Layout,
  dtype: np.dtype,
  out: Q8Array | None = None,
  source_types: Sequence[int] | None = None,
) -> Q8Array:
  """Tensors of one shape (each `data`'s 34-byte blocks) repacked and stacked along a new
  leading axis: one copy each of q and d into the stacked arrays (in the kernel layout on a
  host where the native library runs: read and transposed in one pass).

  shape: each tensor's numpy order `[*lead, n_out, n_in]`; the result's q and scale have a
  leading axis of len(datas), and its `axis` is one tensor's blocked axis. `out`: where to
  write them (q and scale C-contiguous, of those shapes; e.g. layers [a, b) of a larger
  stack), else new arrays. `source_types`: each data's GGML type, where some are not Q8_0 and
  `requantizes_on_the_way` holds for them: requantized to Q8_0 in the same pass.
  """
  rows, n_in = shape[:-1], shape[-1]
  nb = n_in // BLOCK
  n = len(datas)
  q_shape, scale_shape, axis = q8_shapes(shape, layout)
  transposed = layout == "kernel" and len(shape) >= 2
  lead = int(np.prod(rows[:-1]))
  if out is None:
    q = aligned_empty((n, *q_shape), np.int8)
    scale = aligned_empty((n, *scale_shape), scale_dtype)
  else:
    q, scale = out.q, out.scale
    if q.shape != (n, *q_shape) or scale.shape != (n, *scale_shape) or scale.dtype != scale_dtype:
      raise ValueError(
        f"repack_q8_layers: out is q {q.shape}, scale {scale.dtype}{scale.shape}; expected"
        f" {(n, *q_shape)} and {np.dtype(scale_dtype)}{(n, *scale_shape)}"
      )
  gathered = None
  native_scales = _native_scales(byteorder, scale.dtype)
  # kernel layout: the native library transposes straight from the file's blocks, every
  # tensor in one call (the scales too, in the same pass, when their bytes are the param's);
  # else the values are gathered row by row (32-byte runs) and transposed in XLA's tiled
  # kernel (numpy's element-wise transposing copy of int8 runs at a fraction of memory speed)
  scale_out = scale.reshape(n * lead, nb, rows[-1]) if transposed and native_scales else None
  types = [Q8_0] * n if source_types is None else [int(t) for t in source_types]
  sizes = [rows[-1] * n_in // block_of(t)[0] * block_of(t)[1] for t in types]  # one matrix
  parts = [
    d.reshape(-1)[j * size : (j + 1) * size]
    for d, size in zip(datas, sizes, strict=True)
    for j in range(lead)
  ]
  if any(t != Q8_0 for t in types) and not (
    transposed and scale_out is not None and requantizes_on_the_way(layout, scale.dtype, types)
  ):
    raise ValueError(f"repack_q8_layers: cannot requantize GGML types {sorted(set(types))} here")
  native = (
    transposed
    and n * lead > 0
    and native_repack.repack_q8_transposed(
      parts,
      q.reshape(n * lead, nb * BLOCK, rows[-1]),
      scale_out,
      source_types=[t for t in types for _ in range(lead)],
    )
  )
  for i, data in enumerate(datas):
    if native and scale_out is not None:
      continue
    blocks = data.reshape(-1).view(block_dtype(byteorder))
    d = blocks["d"].reshape(*rows, nb)
    if native:
      np.copyto(scale[i], np.swapaxes(d, -1, -2))
      continue
    np.copyto(scale[i], np.swapaxes(d, -1, -2) if transposed else d)
    if gathered is None:
      gathered = np.empty((*rows, nb, BLOCK), np.int8)
    np.copyto(gathered, blocks["qs"].reshape(*rows, nb, BLOCK))  # from views of the mapping
    if transposed:
      q[i] = np.asarray(_transpose_last_two(gathered.reshape(*rows, nb * BLOCK)))
    else:
      q[i] = gathered.reshape(q_shape)
  return Q8Array(q=q.reshape(n, *q_shape), scale=scale, axis=axis, dtype=dtype)


def repack_q8_fused(
  datas: Sequence[Sequence[np.ndarray]],
  rows: Sequence[int],
  n_in: int,
  byteorder: str,
  scale_dtype: np.dtype,
  dtype: np.dtype,
  out: Q8Array | None = None,
  source_types: Sequence[Sequence[int] | None] | None = None,
) -> Q8Array:
  """Member j's per-layer tensors (`datas[j]`, each (rows[j], n_in) as 34-byte blocks) repacked
  into columns [sum(rows[:j]), sum(rows[:j + 1])) of one (layers, K, N) Q8Array in the kernel
  layout: each value copied once, straight into its place (in `out`'s q and scale where given,
  e.g. layers [a, b) of a larger stack). `source_types[j]`: member j's tensors' GGML types
  (None: all Q8_0), where some are not Q8_0 and `requantizes_on_the_way` holds for them:
  requantized to Q8_0 in the same pass."""
  nb, n, layers = n_in // BLOCK, sum(rows), len(datas[0])
  if out is None:
    q = aligned_empty((layers, n_in, n), np.int8)
    scale = aligned_empty((layers, nb, n), scale_dtype)
  else:
    q, scale = out.q, out.scale
    if q.shape != (layers, n_in, n) or scale.shape != (layers, nb, n):
      raise ValueError(
        f"repack_q8_fused: out is q {q.shape}, scale {scale.shape}; expected"
        f" {(layers, n_in, n)} and {(layers, nb, n)}"
      )
  offsets = np.cumsum([0, *rows])
  native_scales = _native_scales(byteorder, scale.dtype)
  for j, member in enumerate(datas):
    n0, n1 = int(offsets[j]), int(offsets[j + 1])
    scale_out = scale[:, :, n0:n1] if native_scales else None  # every layer in one call
    member_types = None if source_types is None else source_types[j]
    types = [Q8_0] * layers if member_types is None else [int(t) for t in member_types]
    if any(t != Q8_0 for t in types) and not (
      scale_out is not None and requantizes_on_the_way("kernel", scale.dtype, types)
    ):
      raise ValueError(f"repack_q8_fused: cannot requantize GGML types {sorted(set(types))} here")
    ran = native_repack.repack_q8_transposed(
      [data.reshape(-1) for data in member], q[:, :, n0:n1], scale_out, source_types=types
    )
    for i, data in enumerate(member):
      if ran and scale_out is not None:
        continue
      blocks = data.reshape(-1).view(block_dtype(byteorder))
      if not ran or scale_out is None:
        np.copyto(scale[i, :, n0:n1], blocks["d"].reshape(rows[j], nb).T)
      if not ran:
        gathered = blocks["qs"].reshape(rows[j], nb * BLOCK)
        q[i, :, n0:n1] = np.asarray(_transpose_last_two(np.ascontiguousarray(gathered)))
  axis = q8_shapes((n, n_in), "kernel")[2]  # one layer's blocked axis, as `get_stacked` has it
  return Q8Array(q=q, scale=scale, axis=axis, dtype=dtype)


def requantizes_on_the_way(layout: Layout, scale_dtype: np.dtype, types: Sequence[int]) -> bool:
  """Whether tensors of GGML `types` (little-endian blocks) repack into `layout` with
  `scale_dtype` scales straight from their own blocks, those not Q8_0 requantized in the same
  pass: the kernel layout, float16 scales, on a little-endian host where the native library
  reads every type (`requant_native_types`)."""
  return (
    layout == "kernel"
    and np.dtype(scale_dtype) == np.float16
    and sys.byteorder == "little"
    and {int(t) for t in types} <= requant_native_types()
  )


def _native_scales(byteorder: str, scale_dtype: np.dtype) -> bool:
  """Whether the native repack can copy the file's scale bytes as they are: float16 params
  from a file in this host's byte order (else numpy converts them)."""
  host = "<" if sys.byteorder == "little" else ">"
  return np.dtype(scale_dtype) == np.float16 and byteorder == host


__all__ = ["repack_q8", "repack_q8_fused", "repack_q8_layers", "requantizes_on_the_way"]
