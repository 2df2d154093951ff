"""Host arrays that JAX's CPU client adopts without copying them.

On the CPU backend `jax.device_put` of a numpy array aliases the array's memory when it
starts on a 64-byte boundary (PJRT's zero-copy host buffers) and copies it otherwise
(measured on jaxlib 0.10: 0-, 64- and 128-byte offsets from a 256-byte boundary are
aliased, 16 and 32 copied). numpy's large allocations start 16 bytes into a page, so each
tensor a checkpoint reader repacked was copied once more on its way into the param tree
(0.3-0.6 s of a 1.03 GB file's load). The readers allocate their outputs here instead; on
other backends nothing changes (the transfer copies either way).

The arrays are the readers' own (never views of the file's mapping), and nothing writes to
them after they are returned, so aliasing them is safe.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ALIGN = 64
"""Bytes: the boundary each array starts on."""


def aligned_empty(shape: tuple[int, ...] | list[int], dtype: Any) -> np.ndarray:
  """`np.empty(shape, dtype)` whose data starts on an `ALIGN`-byte boundary (C order)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start : start + nbytes].view(dtype).reshape(shape)


def is_aligned(a: np.ndarray) -> bool:
  """Whether `a`'s data starts on an `ALIGN`-byte boundary."""
  return a.ctypes.data % ALIGN == 0


__all__ = ["ALIGN", "aligned_empty", "is_aligned"]
