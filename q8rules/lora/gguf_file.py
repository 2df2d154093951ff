"""llama.cpp's LoRA adapter files: what `convert_lora_to_gguf.py` writes and `llama_adapter_lora_init`
reads.

The file's metadata: `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`
(float32) and `general.architecture` equal to the base model's. Its tensors come in pairs
named after the base tensor they adapt: `<base>.lora_a` with ggml ne = [n_in, rank] (numpy
(rank, n_in): A transposed) and `<base>.lora_b` with ne = [rank, n_out] (numpy (n_out, rank):
B transposed). llama.cpp adds `scale * B @ (A @ x)` to the base's product, with
`scale = lora_scale * alpha / rank` (`lora_scale` when alpha is 0), rank = `lora_b`'s ne[0].

A stack of experts' tensor (`blk.N.ffn_up_exps.weight`, ggml [n_in, n_out, n_expert]) has one
adapter per expert: `lora_a` ne = [n_in, rank, n_expert] (numpy (E, rank, n_in)) and `lora_b`
ne = [rank, n_out, n_expert] (numpy (E, n_out, rank)); llama.cpp's `build_lora_mm_id`
(src/llama-graph.cpp) runs each routed row through its expert's pair by `ggml_mul_mat_id` and
adds `scale * B_e @ (A_e @ x)` to that expert's product (its loader, src/llama-adapter.cpp, checks
ne[0] and ne[1] as for a matrix).

Here an adapter is (A (n_in, rank), B (rank, n_out)) float32, the orientation of
`q8rules.Q8LoraProvider`'s params (x @ A @ B); an expert stack's (A (E, n_in, rank),
B (E, rank, n_out)).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import gguf as gguf_lib
import numpy as np
from gguf import GGMLQuantizationType

from q8rules.checkpoint._common import CheckpointError

SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"
"""The suffixes of an adapter pair's tensor names in llama.cpp's files."""

_DTYPES = {
  "f32": (np.float32, GGMLQuantizationType.F32),
  "f16": (np.float16, GGMLQuantizationType.F16),
}


class LoraFile(NamedTuple):
  """A llama.cpp LoRA adapter file, read.

  Attributes:
    path: the file.
    arch: its `general.architecture`.
    alpha: its `adapter.lora.alpha` (0.0 when absent: llama.cpp then scales by lora_scale alone).
    adapters: base tensor name -> (A (n_in, rank), B (rank, n_out)) float32; an expert
      stack's (A (E, n_in, rank), B (E, rank, n_out)).
  """

  path: str
  arch: str
  alpha: float
  adapters: dict[str, tuple[np.ndarray, np.ndarray]]

  def scale(self, name: str, lora_scale: float) -> float:
    """llama.cpp's factor on `name`'s delta: lora_scale * alpha / rank, or lora_scale when
    alpha is 0."""
    rank = self.adapters[name][0].shape[-1]
    return lora_scale * self.alpha / rank if self.alpha else lora_scale


def save_lora_gguf(
  path: str | os.PathLike[str],
  adapters: Mapping[str, tuple[Any, Any]],
  *,
  arch: str,
  alpha: float,
  dtype: str = "f32",
  name: str | None = None,
) -> Path:
  """Write `adapters` as a llama.cpp LoRA adapter file (see the module).

  Args:
    path: the file to write; written to a temporary file beside it, then renamed.
    adapters: base tensor name ('blk.0.attn_q.weight') -> (A (n_in, rank), B (rank, n_out));
      an expert stack's ('blk.0.ffn_up_exps.weight') -> (A (E, n_in, rank), B (E, rank, n_out)).
    arch: the base model's `general.architecture`.
    alpha: `adapter.lora.alpha` (> 0).
    dtype: 'f32' or 'f16', the tensors' type in the file.
    name: `general.name` (default: none written).

  Returns:
    The path written.

  Raises:
    ValueError naming the tensor: shapes that are not (n_in, r) and (r, n_out) (or
      (E, n_in, r) and (E, r, n_out)), non-finite
    values, values that overflow float16 with dtype='f16'; an alpha that is not finite and > 0.
    CheckpointError naming the path: it cannot be written (nothing is left behind).
  """
  path = Path(path)
  if dtype not in _DTYPES:
    raise ValueError(f"{path}: dtype must be one of {list(_DTYPES)}, got {dtype!r}")
  if isinstance(alpha, bool) or not (
    isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0
  ):
    raise ValueError(f"{path}: adapter.lora.alpha must be a finite number > 0, got {alpha!r}")
  if not adapters:
    raise ValueError(f"{path}: no adapter to write")
  np_dtype, _ = _DTYPES[dtype]
  tensors: list[tuple[str, np.ndarray]] = []
  for base, (a, b) in adapters.items():
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if (
      a.ndim not in (2, 3)
      or b.ndim != a.ndim
      or a.shape[:-2] != b.shape[:-2]
      or a.shape[-1] != b.shape[-2]
    ):
      raise ValueError(
        f"{path}: LoRA adapter of {base}: A {a.shape} and B {b.shape} are not (n_in, rank) and"
        " (rank, n_out), or (E, n_in, rank) and (E, rank, n_out) for a stack of experts"
      )
    for part, value in (("A", a), ("B", b)):
      if not np.isfinite(value).all():
        raise ValueError(f"{path}: LoRA {part} of {base} holds non-finite values")
      if dtype == "f16" and np.abs(value).max(initial=0) > np.finfo(np.float16).max:
        raise ValueError(f"{path}: LoRA {part} of {base} overflows float16; write dtype='f32'")
    tensors.append((base + SUFFIX_A, np.ascontiguousarray(np.swapaxes(a, -1, -2), np_dtype)))
    tensors.append((base + SUFFIX_B, np.ascontiguousarray(np.swapaxes(b, -1, -2), np_dtype)))
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:  # created with the umask's mode, as `open` makes any other file (mkstemp's is 0600)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))
  except OSError as e:
    raise CheckpointError(f"{path}: cannot write the adapter file there: {e}") from e
  try:
    writer = gguf_lib.GGUFWriter(tmp, arch)
    writer.add_type(gguf_lib.GGUFType.ADAPTER)
    writer.add_string(gguf_lib.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf_lib.Keys.Adapter.LORA_ALPHA, float(alpha))
    if name:
      writer.add_name(name)
    for tensor_name, value in tensors:
      writer.add_tensor(tensor_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
  except BaseException as e:
    Path(tmp).unlink(missing_ok=True)
    if isinstance(e, OSError):
      raise CheckpointError(f"{path}: writing the adapter file failed: {e}") from e
    raise
  return path


def _field(reader: gguf_lib.GGUFReader, key: str) -> Any:
  field = reader.get_field(key)
  return None if field is None else field.contents()


def read_lora_gguf(path: str | os.PathLike[str]) -> LoraFile:
  """Read a llama.cpp LoRA adapter file (ours or one `convert_lora_to_gguf.py` wrote).

  Norm tensors (`*_norm.weight`), which llama.cpp also skips, are skipped with a warning.

  Raises:
    CheckpointError naming the file (and tensor): not a GGUF or truncated, `general.type` not
    'adapter', `adapter.type` not 'lora', a tensor of another suffix, a pair missing a half,
    A and B of different ranks (or, for an expert stack's pair, expert counts), non-finite
    values.
  """
  path = str(path)
  try:
    reader = gguf_lib.GGUFReader(path)
  except (OSError, ValueError, KeyError, IndexError) as e:
    raise CheckpointError(f"{path}: not a readable GGUF adapter file: {e}") from e
  kind = _field(reader, gguf_lib.Keys.General.TYPE)
  if kind != "adapter":
    raise CheckpointError(f"{path}: general.type is {kind!r}, not 'adapter': not a LoRA adapter")
  adapter_type = _field(reader, gguf_lib.Keys.Adapter.TYPE)
  if adapter_type != "lora":
    raise CheckpointError(f"{path}: adapter.type is {adapter_type!r}, not 'lora'")
  arch = _field(reader, gguf_lib.Keys.General.ARCHITECTURE)
  alpha = _field(reader, gguf_lib.Keys.Adapter.LORA_ALPHA)
  alpha = 0.0 if alpha is None else float(alpha)
  if not math.isfinite(alpha) or alpha < 0:
    raise CheckpointError(f"{path}: adapter.lora.alpha = {alpha} is not a finite number >= 0")
  halves: dict[str, dict[str, np.ndarray]] = {}
  skipped = []
  for t in reader.tensors:
    name = t.name
    if name.endswith((SUFFIX_A, SUFFIX_B)):
      base, part = name[: -len(SUFFIX_A)], name[-1]
      try:
        value = gguf_lib.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
      except (NotImplementedError, ValueError) as e:
        raise CheckpointError(f"{path}: tensor {name!r} of type {t.tensor_type.name}: {e}") from e
      value = value.reshape(tuple(int(d) for d in reversed(t.shape)))  # numpy order
      if not np.isfinite(value).all():
        raise CheckpointError(f"{path}: tensor {name!r} holds non-finite values")
      halves.setdefault(base, {})[part] = value
    elif name.endswith("_norm.weight"):
      skipped.append(name)
    else:
      raise CheckpointError(
        f"{path}: tensor {name!r} has an unexpected suffix (not .lora_a / .lora_b)"
      )
  if skipped:
    warnings.warn(
      f"{path}: {len(skipped)} norm tensor(s) skipped, as llama.cpp skips them", stacklevel=2
    )
  adapters = {}
  for base, parts in halves.items():
    if set(parts) != {"a", "b"}:
      raise CheckpointError(
        f"{path}: the LoRA pair of {base!r} is missing its lora_{'ab'[('a' in parts)]}"
      )
    a_t, b_t = parts["a"], parts["b"]  # (*E, rank, n_in), (*E, n_out, rank)
    if (
      a_t.ndim not in (2, 3)
      or b_t.ndim != a_t.ndim
      or a_t.shape[:-2] != b_t.shape[:-2]
      or a_t.shape[-2] != b_t.shape[-1]
    ):
      raise CheckpointError(
        f"{path}: LoRA pair of {base!r}: lora_a {a_t.shape[::-1]} and lora_b {b_t.shape[::-1]}"
        " (ggml ne) are not [n_in, rank] and [rank, n_out] of one rank (or [n_in, rank,"
        " n_expert] and [rank, n_out, n_expert] for a stack of experts)"
      )
    adapters[base] = (
      np.ascontiguousarray(np.swapaxes(a_t, -1, -2)),
      np.ascontiguousarray(np.swapaxes(b_t, -1, -2)),
    )
  if not adapters:
    raise CheckpointError(f"{path}: the adapter file holds no LoRA pair")
  return LoraFile(path, str(arch), alpha, adapters)


__all__ = ["SUFFIX_A", "SUFFIX_B", "LoraFile", "read_lora_gguf", "save_lora_gguf"]
