"""Float64 references for the ecosystem tests: a weight's Q8_0 round trip, exactly, in numpy."""

from __future__ import annotations

import jax
import numpy as np

from q8rules.layout import WeightLayout
from q8rules.q8_0 import quantize
from tests._utils import weight64


def round_trip64(w: jax.Array | np.ndarray, layout: WeightLayout) -> np.ndarray:
  """The values Q8_0 serving computes with for `w` stored in `layout`, in float64 of `w`'s
  shape: the (K, N) matrix quantized along K (padded to a multiple of 32), `q * d` exactly."""
  m = np.asarray(layout.to_matrix(w))
  a = quantize(m, axis=0)
  full = weight64(a.q, a.scale)[: layout.k]
  order = layout.contract + layout.free
  moved = full.reshape(tuple(layout.shape[i] for i in order))
  return np.transpose(moved, np.argsort(order))


def rows_layout(shape: tuple[int, ...], axis: int = 0) -> WeightLayout:
  """A table looked up along `axis` (its other axes are K: a row's blocks)."""
  return WeightLayout(tuple(shape), tuple(a for a in range(len(shape)) if a != axis), (axis,))


def dense_layout(shape: tuple[int, ...], k_axes: int = 1) -> WeightLayout:
  """A weight whose first `k_axes` axes are contracted (a Dense kernel (in, out): 1)."""
  n = len(shape)
  return WeightLayout(tuple(shape), tuple(range(k_axes)), tuple(range(k_axes, n)))
