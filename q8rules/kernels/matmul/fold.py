"""When the fold applies, and the fold itself with its gradient: `q8_fold`.

The fold (`pallas_mosaic_tpu`, `pallas_triton`) serves decode-shaped products: a few rows
of activations against a Q8_0 weight, reading the int8 values and scales once
for all the rows. It applies (`fold_applies`) when

  * m is at most a tile's rows: 8 on TPU (an f32 sublane tile), 16 on GPU
    (Triton's smallest dot); on CPU the TPU form runs in interpret mode, 8;
  * K is whole Q8_0 blocks (a multiple of 32);
  * it moves no more bytes than reading the weight dense in bf16:
    m*K*itemsize*column_tiles + K*N*1.125 (+ 8*S*m*N for the GPU form's S
    K-slice partials, written and read once) <= K*N*2 (x is re-read once per
    column tile; int8 plus one f32 scale per 32 values is 1.125 bytes each).

Columns are the kernel's column tiles, the last padded with zero values and
zero scales (N=40, a tensor-parallel chip's share of heads, becomes one tile of
128 on TPU), so the pad's sums land only in the result's pad, which is sliced
off. Padding copies the weight on each call: keep N a multiple of the tile
(128 on TPU, 64 on GPU) for weights that are served often.

As one of `kernels.api`'s implementations the module gives `cannot` (the shape; on GPU, a
device too old for Triton), `slower` (the bytes rule; always on CPU) and `run`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.kernels.matmul import pallas_mosaic_tpu, pallas_triton
from q8rules.kernels.matmul.xla_chunked import q8_matmul_xla
from q8rules.kernels.matmul_t.api import q8_matmul_t
from q8rules.kernels.problem import Problem, check_operands, platform_of
from q8rules.q8_0 import BLOCK, Q8Array

NAME = "fold"
SUMMARY = "the Pallas fold (Mosaic TPU, Triton GPU; interpret mode on CPU), decode-shaped products"
ROUNDS_WEIGHT = False
"""Every product is exact; only the float32 accumulation rounds."""

TILE_ROWS = {"tpu": pallas_mosaic_tpu.TILE_ROWS, "gpu": pallas_triton.TILE_ROWS}
"""Rows one fold call takes, per kernel form: TPU 8, GPU 16."""

_FORM_OF = {"tpu": "tpu", "cpu": "tpu", "gpu": "gpu"}  # per platform; the CPU interprets TPU's
_KERNELS = {"tpu": pallas_mosaic_tpu, "gpu": pallas_triton}
_DENSE_BYTES = 2.0  # a bf16 weight value
_Q8_BYTES = 1.125  # an int8 value plus 1/32 of an f32 scale


def kernel_form(backend: str | None = None) -> str:
  """'tpu' or 'gpu': the fold kernel a backend runs.

  backend: 'tpu', 'gpu' ('cuda', 'rocm'), 'cpu' (the TPU form, interpreted) or
  None for `jax.default_backend()`.
  """
  return _FORM_OF[platform_of(backend)]


def padded_columns(n: int, form: str, block_n: int | None = None) -> int:
  """N rounded up to a whole number of the form's column tiles (`block_n`, default the
  form's `column_tile(N)`)."""
  tn = block_n or _KERNELS[form].column_tile(n)
  return -(-n // tn) * tn


def _shape_reason(m: int, k: int, n: int, form: str) -> str | None:
  """Why the kernel cannot run an (m, K) x (K, N) product at all, or None."""
  rows = TILE_ROWS[form]
  if m < 1:
    return f"m={m}: no rows to fold"
  if m > rows:
    return f"m={m} > {rows} tile rows"
  if k < 1 or k % BLOCK:
    return f"K={k} not a multiple of {BLOCK}"
  if n < 1:
    return f"N={n}: no columns"
  return None


def _bytes_reason(p: Problem) -> str | None:
  """Why the fold moves more bytes than a dense bf16 weight for `p` (None: it moves fewer)."""
  form = _FORM_OF[p.platform]
  tiles = padded_columns(p.n, form) // _KERNELS[form].column_tile(p.n)
  fold_bytes = p.m * p.k * p.itemsize * tiles + p.k * p.n * _Q8_BYTES
  if form == "gpu" and (splits := pallas_triton.k_splits(p.k, p.n)) > 1:
    fold_bytes += 8 * splits * p.m * p.n  # the f32 partials, written and read
  dense_bytes = p.k * p.n * _DENSE_BYTES
  if fold_bytes > dense_bytes:
    return (
      f"the fold moves {fold_bytes:.0f} bytes (x re-read over {tiles} column tiles)"
      f" > {dense_bytes:.0f} for the weight in bf16"
    )
  return None


def cannot(p: Problem) -> str | None:
  """Why the fold kernel cannot take `p` at all, or None: the shape (m over the form's tile
  rows, K not whole blocks, nothing to fold), or (GPU) a device older than Triton needs."""
  if p.platform == "gpu" and (reason := pallas_triton.device_reason()):
    return reason
  return _shape_reason(p.m, p.k, p.n, _FORM_OF[p.platform])


def slower(p: Problem) -> str | None:
  """Why `implementation=None` passes the fold over for `p`: on CPU it only interprets; else
  when it moves more bytes than a dense bf16 weight (m*K*itemsize*column_tiles + K*N*1.125,
  plus the GPU form's f32 partials, against K*N*2)."""
  if p.platform == "cpu":
    return "on CPU the fold runs only in Pallas interpret mode"
  return _bytes_reason(p)


def fold_applies(m: int, k: int, n: int, *, backend: str | None = None, itemsize: int = 2) -> bool:
  """Whether the fold suits an (m, K) x (K, N) product on `backend` ('tpu', 'gpu', 'cuda',
  'rocm', 'cpu' (the TPU form, interpreted), None: `jax.default_backend()`) with activations
  of `itemsize` bytes: m up to a tile's rows (TPU 8, GPU 16), whole Q8_0 blocks of K, and no
  more bytes moved than a dense bf16 weight (see `cannot` and `slower`)."""
  p = Problem(int(m), int(k), int(n), int(itemsize), platform_of(backend))
  return cannot(p) is None and _bytes_reason(p) is None


def _run_kernel(
  x2d, q, scale, form: str, block_n: int | None, splits: int | None, interpret: bool
) -> jax.Array:
  """The kernel on N padded to whole column tiles: (m, N) float32."""
  n = q.shape[1]
  tn = block_n or _KERNELS[form].column_tile(n)
  pad = padded_columns(n, form, tn) - n
  if pad:  # zero values and zero scales: the pad's sums stay in the pad
    q = jnp.pad(q, ((0, 0), (0, pad)))
    scale = jnp.pad(scale, ((0, 0), (0, pad)))
  if form == "tpu":
    out = pallas_mosaic_tpu.fold_tpu(x2d, q, scale, block_n=tn, interpret=interpret)
  else:
    out = pallas_triton.fold_gpu(x2d, q, scale, block_n=tn, splits=splits, interpret=interpret)
  return out[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fold(x2d, q, scale, form, block_n, splits, interpret):
  return _run_kernel(x2d, q, scale, form, block_n, splits, interpret)


def _fold_fwd(x2d, q, scale, form, block_n, splits, interpret):
  return _run_kernel(x2d, q, scale, form, block_n, splits, interpret), (x2d, q, scale)


def _fold_bwd(form, block_n, splits, interpret, res, dy):
  """dx = dy @ W^T by op 'matmul_t' (the native kernel on the CPU up to 16 rows, XLA's chunks
  elsewhere); dscale[b, n] = sum_r dy[r, n] sum_i x[r, 32b+i] q[32b+i, n] by the transpose
  of the XLA scan (`xla_chunked`); no dq (the int8 values are frozen). Neither builds the
  whole float weight."""
  del form, block_n, splits, interpret
  x2d, q, scale = res
  dx = q8_matmul_t(dy, Q8Array(q, scale), preferred_element_type=x2d.dtype)
  _, scale_vjp = jax.vjp(lambda s: q8_matmul_xla(x2d, q, s), scale)
  (dscale,) = scale_vjp(dy)
  dq = np.zeros(q.shape, dtype=jax.dtypes.float0)
  return dx, dq, dscale


_fold.defvjp(_fold_fwd, _fold_bwd)
_fold_jit = jax.jit(_fold, static_argnums=(3, 4, 5, 6))


def run(x2d: jax.Array, q: jax.Array, scale: jax.Array, platform: str, interpret: bool | None):
  """The registry's call: x2d (m, K) @ (q (K, N) int8 * scale (K/32, N)) -> (m, N) float32,
  with the form of `platform` ('cpu', 'gpu', 'tpu'; operands and shape already checked);
  `interpret` None: on CPU only."""
  interpret = platform == "cpu" if interpret is None else interpret
  return _fold_jit(x2d, q, scale, _FORM_OF[platform], None, None, bool(interpret))


def q8_fold(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  *,
  backend: str | None = None,
  interpret: bool | None = None,
  block_n: int | None = None,
  splits: int | None = None,
) -> jax.Array:
  """`x2d @ (q * scale)` with the fold kernel: (m, N) float32.

  Args:
    x2d: (m, K) float32, bfloat16 or float16; m up to the form's tile rows.
    q: (K, N) int8, K a multiple of 32.
    scale: (K/32, N) float32 or float16.
    backend: which kernel: 'tpu' (Mosaic), 'gpu' (Triton), 'cpu' (the TPU
      form) or None for `jax.default_backend()`.
    interpret: Pallas interpret mode; None: when the kernel's platform is not
      the default backend (so always on CPU).
    block_n: the column tile (default: the form's `column_tile(N)`).
    splits: the GPU form's K slices, dividing K/32 (default
      `pallas_triton.k_splits`); the TPU form walks K in its grid and takes none.

  Differentiable (`jax.custom_vjp`) in x (by op 'matmul_t') and in scale (by the XLA
  scan's transpose); q is integer and gets no gradient. Raises ValueError when the
  kernel cannot take the shape (m over the tile rows, K not whole blocks) but
  not on the bytes rule of `fold_applies`, which is advice on speed.
  """
  form = kernel_form(backend)
  check_operands(x2d, Q8Array(q=q, scale=scale), what="q8_fold")
  if x2d.ndim != 2:
    raise ValueError(f"q8_fold: x must be (m, K), got shape {tuple(x2d.shape)}")
  reason = _shape_reason(x2d.shape[0], q.shape[0], q.shape[1], form)
  if reason:
    raise ValueError(f"q8_fold ({form} form): {reason}")
  if splits is not None and form != "gpu":
    raise ValueError(f"q8_fold ({form} form): splits= is for the GPU form")
  if interpret is None:  # interpret unless the kernel's own platform runs this program
    interpret = jax.default_backend() != form
  return _fold_jit(x2d, q, scale, form, block_n, splits, bool(interpret))


__all__ = [
  "NAME",
  "ROUNDS_WEIGHT",
  "SUMMARY",
  "TILE_ROWS",
  "cannot",
  "fold_applies",
  "kernel_form",
  "padded_columns",
  "q8_fold",
  "run",
  "slower",
]
