"""The fold on GPU: a split-K Pallas Triton kernel for decode-shaped Q8_0 products.

`y = x @ W` for x (m, K), m <= 16, and a Q8_0 weight W = q * d (q int8 (K, N),
d float32 (K/32, N)). The TPU form (`pallas_mosaic_tpu`) does not lower for CUDA (its
carry lives in VMEM: "Unsupported memory space: vmem"); this one keeps the
carry in registers. Grid (column tiles j, K slices s): program (j, s) owns
columns [j*tn, (j+1)*tn) of K slice s (K/S rows, whole Q8_0 blocks) and walks
it `group` blocks per `fori_loop` step (Triton software-pipelines the loads
over `num_stages`), one (16, 32) x (32, tn) `tl.dot` per block (Triton's dot
needs M, N, K >= 16, hence rows padded to 16) scaled down its columns into an
fp32 (16, tn) register accumulator: acc[r, n] += d[b, n] * sum_i x[r, 32b + i]
q[32b + i, n]. Each program stores its m live rows (a masked store) into an
(S, 16, N) fp32 partial and XLA adds the S partials: splitting K gives a GPU
enough programs (`k_splits`) when N alone makes few column tiles (N = 4096 is
64 tiles of 64 for 132 SMs). Numerics: bf16/f16 activations are dotted with q
cast to their dtype (exact) with fp32 accumulation; float32 activations use
`Precision.HIGHEST` (IEEE, not TF32); scales are float32 (float16 upcast) and
multiply each block's fp32 sums. Every value the kernel loads is a power-of-two
shape ((16, 32), (32, tn), (1, tn)), as Triton needs, so K is any multiple of
32; N must be a multiple of tn (`q8rules.kernels.matmul.fold.q8_fold` pads the columns
with zero values and scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from q8rules.kernels.matmul._pallas_compat import pl, plgpu, triton_compiler_params
from q8rules.q8_0 import BLOCK

TILE_ROWS = 16
"""Activation rows one call folds (Triton's smallest dot M); m <= 16, padded to 16."""

BLOCK_N = 64
"""Default column tile: 64 columns a program."""

MAX_GROUP = 4
"""Q8_0 blocks unrolled in one K-loop step (128 rows)."""

NUM_WARPS = 4
NUM_STAGES = 4

SM_COUNT = 132
"""Streaming multiprocessors assumed when no CUDA device is attached (H100 SXM, H200)."""

PROGRAMS_PER_SM = 2
"""`k_splits` splits K until the grid has at least this many programs per SM."""

MIN_SLICE_BLOCKS = 8
"""The fewest Q8_0 blocks (256 rows) one K slice takes, so a program's loop amortises its
start and its partial's store."""

MIN_COMPUTE_CAPABILITY = (8, 0)
"""Pallas' Triton backend needs compute capability 8.0 or newer (jax-ml/jax#26799): a
Colab T4 (7.5) cannot run this form."""


@functools.cache
def _first_cuda_capability() -> tuple[int, int] | None:
  try:
    devices = jax.devices("cuda")
  except RuntimeError:  # no CUDA backend in this process (a CPU, TPU or ROCm host)
    return None
  capability = getattr(devices[0], "compute_capability", None) if devices else None
  if not capability:
    return None
  major, minor = str(capability).split(".")[:2]
  return int(major), int(minor)


def compute_capability() -> tuple[int, int] | None:
  """(major, minor) of this process's first CUDA device, or None when it has none."""
  return _first_cuda_capability()


def device_reason() -> str | None:
  """Why this process's GPU cannot run the Triton form, or None (also where no GPU is
  attached, as when lowering for export from another host)."""
  capability = compute_capability()
  if capability is not None and capability < MIN_COMPUTE_CAPABILITY:
    return (
      f"Pallas Triton needs compute capability {MIN_COMPUTE_CAPABILITY[0]}."
      f"{MIN_COMPUTE_CAPABILITY[1]} or newer; this GPU has {capability[0]}.{capability[1]}"
    )
  return None


def blocks_per_step(k: int) -> int:
  """Q8_0 blocks per K-loop step for a slice of K rows: the largest divisor of K/32 <= 4."""
  if k <= 0 or k % BLOCK:
    raise ValueError(f"K={k} is not a positive multiple of {BLOCK}")
  g = min(k // BLOCK, MAX_GROUP)
  while (k // BLOCK) % g:
    g -= 1
  return g


@functools.cache
def _first_cuda_sm_count() -> int | None:
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  count = getattr(devices[0], "core_count", None) if devices else None
  return int(count) if count else None


def sm_count() -> int:
  """SMs of this process's first CUDA device, or `SM_COUNT` where none is attached."""
  return _first_cuda_sm_count() or SM_COUNT


def k_splits(k: int, n: int, block_n: int | None = None, sms: int | None = None) -> int:
  """K slices S for an (., K) x (K, N) fold: the fewest that give the grid at least
  `PROGRAMS_PER_SM` programs per SM, S dividing K/32 with at least `MIN_SLICE_BLOCKS`
  blocks a slice (1 when N's column tiles alone fill the GPU or K is short).

  Args:
    k, n: contraction size (a multiple of 32) and columns.
    block_n: the column tile (default `column_tile(n)`).
    sms: SMs to fill (default `sm_count()`).
  """
  if k <= 0 or k % BLOCK:
    raise ValueError(f"K={k} is not a positive multiple of {BLOCK}")
  blocks = k // BLOCK
  tiles = -(-n // (block_n or column_tile(n)))
  want = -(-PROGRAMS_PER_SM * (sms or sm_count()) // tiles)
  best = 1
  for s in range(1, blocks + 1):
    if blocks % s or blocks // s < MIN_SLICE_BLOCKS:
      continue
    best = s
    if s >= want:
      break
  return best


def column_tile(n: int) -> int:
  """The column tile for N columns (`BLOCK_N`, whatever N)."""
  del n
  return BLOCK_N


def _fold_kernel(x_ref, q_ref, s_ref, o_ref, *, rows, group, precision):
  """One column tile of one K slice.

  x_ref (16, K/S) f32|bf16|f16; q_ref (K/S, tn) int8; s_ref (K/(32 S), tn) f32;
  o_ref (16, tn) f32, of which the first `rows` are stored.
  """
  tile_rows, tn = o_ref.shape
  steps = s_ref.shape[0] // group

  def step(i, acc):
    for g in range(group):  # unrolled: `group` Q8_0 blocks
      b = i * group + g
      block_rows = pl.ds(pl.multiple_of(b * BLOCK, BLOCK), BLOCK)
      xb = x_ref[:, block_rows]  # (16, 32)
      qb = q_ref[block_rows, :].astype(xb.dtype)  # (32, tn), exact
      part = jnp.dot(xb, qb, precision=precision, preferred_element_type=jnp.float32)
      acc = acc + part * s_ref[pl.ds(b, 1), :]  # fold the block down its columns
    return acc

  acc = lax.fori_loop(0, steps, step, jnp.zeros((tile_rows, tn), jnp.float32))
  if rows == tile_rows:
    o_ref[...] = acc
  else:  # the pad rows' sums are zero: never written, never read
    plgpu.store(o_ref, acc, mask=lax.broadcasted_iota(jnp.int32, acc.shape, 0) < rows)


def fold_gpu(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  *,
  block_n: int | None = None,
  splits: int | None = None,
  group: int | None = None,
  interpret: bool = False,
  num_warps: int = NUM_WARPS,
  num_stages: int = NUM_STAGES,
) -> jax.Array:
  """`x2d @ (q * scale)` with the split-K Triton fold kernel.

  Args:
    x2d: (m, K) float32, bfloat16 or float16 activations, 1 <= m <= 16.
    q: (K, N) int8, K a multiple of 32, N a multiple of `block_n`.
    scale: (K/32, N) float32 or float16.
    block_n: the column tile, a power of two >= 16 (default `BLOCK_N`).
    splits: K slices S, dividing K/32 (default `k_splits(K, N, block_n)`).
    group: Q8_0 blocks per loop step, dividing K/(32 S) (default `blocks_per_step`).
    interpret: run the kernel in Pallas interpret mode (any backend).
    num_warps, num_stages: Triton's launch parameters.

  Returns:
    (m, N) float32: the S partials (S, m, N) summed in float32 by XLA.
  """
  m, k = x2d.shape
  n = q.shape[1]
  if not 1 <= m <= TILE_ROWS:
    raise ValueError(f"fold_gpu: m={m} rows; the GPU fold takes 1 to {TILE_ROWS}")
  tn = block_n or column_tile(n)
  if tn < 16 or tn & (tn - 1) or n % tn:
    raise ValueError(
      f"fold_gpu: N={n} must be a multiple of the column tile {tn}, a power of two >= 16"
      " (pad the columns with zero values and scales; see fold.q8_fold)"
    )
  s = splits or k_splits(k, n, tn)
  if k % BLOCK or (k // BLOCK) % s:
    raise ValueError(f"fold_gpu: {s} K slices do not divide K={k} into whole Q8_0 blocks")
  ks = k // s
  g = group or blocks_per_step(ks)
  if (ks // BLOCK) % g:
    raise ValueError(f"fold_gpu: {g} blocks a step do not divide a K slice of {ks} rows")
  x16 = jnp.pad(x2d, ((0, TILE_ROWS - m), (0, 0)))
  precision = jax.lax.Precision.HIGHEST if x16.dtype == jnp.float32 else None
  partials = pl.pallas_call(
    functools.partial(_fold_kernel, rows=m, group=g, precision=precision),
    out_shape=jax.ShapeDtypeStruct((s, TILE_ROWS, n), jnp.float32),
    grid=(n // tn, s),
    in_specs=[
      pl.BlockSpec((TILE_ROWS, ks), lambda j, i: (0, i)),
      pl.BlockSpec((ks, tn), lambda j, i: (i, j)),
      pl.BlockSpec((ks // BLOCK, tn), lambda j, i: (i, j)),
    ],
    out_specs=pl.BlockSpec((None, TILE_ROWS, tn), lambda j, i: (i, 0, j)),
    compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
    interpret=interpret,
    name="q8_fold_gpu",
  )(x16, q, scale.astype(jnp.float32))
  live = partials[:, :m]
  return live[0] if s == 1 else jnp.sum(live, axis=0)


__all__ = [
  "BLOCK_N",
  "SM_COUNT",
  "TILE_ROWS",
  "blocks_per_step",
  "column_tile",
  "fold_gpu",
  "k_splits",
  "sm_count",
]
