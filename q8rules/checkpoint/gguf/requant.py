"""Tensors of GGUF's other types served as Q8_0: what each tensor type is served as
(`TypePolicy`) and the Q8_0 blocks of a tensor that is not Q8_0 in the file (`q8_0_blocks`).

A tensor of another quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ*, TQ*, MXFP4:
whatever `gguf.quants` dequantizes) is dequantized as llama.cpp dequantizes it (gguf-py's
`gguf.quants.dequantize`, which matches ggml's reference dequantizers) and quantized to
Q8_0 with the Q8_0 quantizer (`gguf.quants.quantize`, bit-equal to `q8rules.q8_0` and
llama.cpp's `quantize_row_q8_0_ref`), a few rows at a time: no more than those rows are ever
float. With `quantize='q8_0'` the float weight matrices (F32, F16, BF16) go the same way,
so the blocks equal those `llama-quantize` writes for the file at Q8_0.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import Counter
from collections.abc import Iterable

import gguf as gguf_lib
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf.header import Tensor
from q8rules.checkpoint.gguf.layouts import BLOCK_BYTES, PLAIN_TYPES, Q8_0, dequantizable
from q8rules.checkpoint.gguf.requant_native import requantize_q8_0_native
from q8rules.checkpoint.host_buffers import aligned_empty
from q8rules.q8_0 import BLOCK

F32 = GGMLQuantizationType.F32
F16 = GGMLQuantizationType.F16
BF16 = GGMLQuantizationType.BF16
FLOAT_TYPES = (F32, F16, BF16)
"""The float types `quantize='q8_0'` quantizes (F64 and the integer types are kept)."""

QUANTIZE_CHOICES = (None, "q8_0")
CHUNK_VALUES = 1 << 20
"""About how many values are float at once while a tensor is requantized."""

_KEPT_FLOAT = ("_norm.weight", "ffn_gate_inp.weight", "pos_embd.weight", "token_types.weight")
_KEPT_FLOAT += ("per_layer_model_proj.weight",)
"""Weights `llama-quantize` keeps in float whatever the target type (llama-quant.cpp)."""


def is_quantized(qtype: GGMLQuantizationType) -> bool:
  """Whether `qtype` is a block-quantized type other than Q8_0 (not F32/F16/BF16/F64/I*)."""
  return qtype != Q8_0 and qtype not in PLAIN_TYPES


def quantizes_float(name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
  """Whether `quantize='q8_0'` quantizes this float tensor, as `llama-quantize` picks the
  tensors it quantizes: a weight (`*.weight`) of rank >= 2 whose rows are whole Q8_0 blocks,
  not a norm, a MoE router, a position or token-type embedding, Gemma's per-layer model
  projection."""
  return (
    qtype in FLOAT_TYPES
    and len(shape) >= 2
    and shape[-1] % BLOCK == 0
    and name.endswith(".weight")
    and not name.endswith(_KEPT_FLOAT)
  )


@dataclasses.dataclass(frozen=True)
class TypePolicy:
  """What a GGUF reader serves each tensor as.

  Attributes:
    dequantize_other: tensors of other quantized types come back as float32 arrays instead
      of being requantized to Q8_0 (the default: served as Q8_0).
    quantize: None, or 'q8_0': the float weight matrices (`quantizes_float`) are quantized
      to Q8_0 too.
  """

  dequantize_other: bool = False
  quantize: str | None = None

  def __post_init__(self) -> None:
    if self.quantize not in QUANTIZE_CHOICES:
      raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {self.quantize!r}")

  def served_type(self, t: Tensor) -> GGMLQuantizationType:
    """Q8_0 for a tensor served as a Q8Array (Q8_0 in the file, requantized, or quantized);
    F32 for a quantized tensor dequantized to float32; else the file's type."""
    qtype = t.tensor_type
    if qtype == Q8_0:
      return Q8_0
    if is_quantized(qtype):
      return F32 if self.dequantize_other or len(t.shape) < 2 else Q8_0
    if self.quantize == "q8_0" and quantizes_float(t.name, qtype, t.shape):
      return Q8_0
    return qtype

  def check(self, path: object, tensors: Iterable[Tensor], byteorder: str) -> None:
    """CheckpointError listing every tensor this policy cannot serve: a quantized type
    `gguf.quants` does not know, or a requantized tensor of a big-endian file."""
    bad = []
    for t in tensors:
      qtype = t.tensor_type
      if is_quantized(qtype) and not dequantizable(qtype):
        bad.append(f"{t.name!r}: {qtype.name} (gguf.quants cannot dequantize it)")
      elif qtype != Q8_0 and self.served_type(t) == Q8_0 and byteorder != "<":
        bad.append(f"{t.name!r}: {qtype.name} in a big-endian file (not requantized)")
    if bad:
      raise CheckpointError(f"{path}: {len(bad)} tensor(s) cannot be served:\n" + "\n".join(bad))

  def requantized(self, tensors: Iterable[Tensor]) -> Counter[str]:
    """How many tensors of each file type are served as Q8_0 without being Q8_0 in the file
    (e.g. `Counter({'Q5_0': 81, 'Q4_K': 27, 'Q6_K': 9})`)."""
    return Counter(
      t.tensor_type.name for t in tensors if t.tensor_type != Q8_0 and self.served_type(t) == Q8_0
    )


def describe_requantized(counts: Counter[str]) -> str:
  """One line, e.g. '117 tensors requantized to Q8_0 (81 Q5_0, 27 Q4_K, 9 Q6_K)'; '' if none."""
  if not counts:
    return ""
  n = sum(counts.values())
  kinds = ", ".join(f"{c} {k}" for k, c in counts.most_common())
  return f"{n} tensor{'s' if n != 1 else ''} requantized to Q8_0 ({kinds})"


def _floats(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
  """float32 (r, n_cols) of `rows`, a chunk of the tensor's rows as the file stores them."""
  if qtype == BF16:
    bits = rows.view("<u2").astype(np.uint32) << 16
    return bits.view(np.float32)
  if qtype in (F32, F16):
    return rows.astype(np.float32)
  return np.asarray(gguf_lib.quants.dequantize(rows, qtype), np.float32)


def q8_0_blocks(t: Tensor, *, path: object = "") -> np.ndarray:
  """The Q8_0 blocks of tensor `t` (not Q8_0 in the file): uint8 of shape
  `(*t.shape[:-1], t.shape[-1] // 32 * 34)`, the layout a Q8_0 tensor of `t.shape` has in a
  GGUF file (little-endian float16 scales), ready for `repack`.

  Rows are dequantized (a quantized type) or widened (F16, BF16, F32) and quantized to Q8_0 by
  the native library where it reads the type (`requant_native`: a few thousand values a thread
  at a time, bit-equal to gguf.quants), else by `gguf.quants` about `CHUNK_VALUES` values at a
  time.

  Raises:
    CheckpointError naming the file, tensor and row: a non-finite value (a float weight's,
      or a quantized block's that decodes to inf or NaN: a corrupt block), or rows that are
      not whole Q8_0 blocks.
  """
  shape, qtype = t.shape, t.tensor_type
  n_cols = shape[-1]
  if n_cols % BLOCK:
    raise CheckpointError(
      f"{path}: tensor {t.name!r} ({qtype.name}, shape {shape}): rows of {n_cols} values"
      f" are not whole Q8_0 blocks of {BLOCK}"
    )
  if sys.byteorder != "little":
    raise CheckpointError(f"{path}: tensor {t.name!r}: requantizing needs a little-endian host")
  n_rows = math.prod(shape[:-1])
  src = t.data.reshape(n_rows, -1)
  out = aligned_empty((n_rows, n_cols // BLOCK * BLOCK_BYTES), np.dtype(np.uint8))
  step = max(1, CHUNK_VALUES // n_cols)
  if is_quantized(qtype):  # whole super-blocks per row: `src` rows are whole rows
    block, _ = GGML_QUANT_SIZES[qtype]
    assert n_cols % block == 0, (t.name, qtype, shape)
  what = f"{path}: tensor {t.name!r} ({qtype.name}, shape {shape})"
  if requantize_q8_0_native(src, int(qtype), n_rows, n_cols, out) is not None:
    d = out.reshape(n_rows, -1, BLOCK_BYTES)[..., :2].copy().view(np.float16)
    bad = ~np.isfinite(d).all(axis=(1, 2))
    if bad.any():  # the precise error, from gguf.quants on the rows from the first bad one
      first = int(np.argmax(bad))
      _requantize_numpy(src[first:], qtype, out[first:], step, first, what)
    return out.reshape(*shape[:-1], -1)
  _requantize_numpy(src, qtype, out, step, 0, what)
  return out.reshape(*shape[:-1], -1)


def _requantize_numpy(
  src: np.ndarray, qtype: GGMLQuantizationType, out: np.ndarray, step: int, row0: int, what: str
) -> None:
  """`src`'s rows (as the file stores them) into `out`'s Q8_0 blocks through gguf.quants,
  `step` rows at a time; CheckpointError naming the row (counted from `row0`) of a non-finite
  value or a Q8_0 scale beyond float16."""
  for r in range(0, len(src), step):
    with np.errstate(all="ignore"):
      x = _floats(src[r : r + step], qtype)
      finite = np.isfinite(x).all(axis=-1)
      if finite.all():
        out[r : r + step] = gguf_lib.quants.quantize(x, Q8_0)
    if not finite.all():
      kind = "a corrupt block" if is_quantized(qtype) else "a non-finite weight"
      raise CheckpointError(
        f"{what}: row {row0 + r + int(np.argmin(finite))} holds a non-finite value ({kind});"
        " it cannot be served as Q8_0"
      )
    check_scales(out[r : r + step], row0 + r, what)


def check_scales(blocks: np.ndarray, first_row: int, what: str) -> None:
  """CheckpointError naming the row when a Q8_0 scale of `blocks` ((rows, row bytes) uint8)
  is not finite: a block whose largest magnitude exceeds 127 times float16's largest value."""
  d = blocks.reshape(len(blocks), -1, BLOCK_BYTES)[..., :2].copy().view(np.float16)
  ok = np.isfinite(d).all(axis=(1, 2))
  if not ok.all():
    raise CheckpointError(
      f"{what}: row {first_row + int(np.argmin(ok))} holds a value beyond 127 times float16's"
      " largest, whose Q8_0 scale would be inf; it cannot be served as Q8_0"
    )


__all__ = [
  "QUANTIZE_CHOICES",
  "TypePolicy",
  "describe_requantized",
  "is_quantized",
  "q8_0_blocks",
  "quantizes_float",
]
