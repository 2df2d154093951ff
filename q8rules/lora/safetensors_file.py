"""LoRA adapters as safetensors files, without their base, bit for bit.

Names. The adapter of the Q8 param 'blocks/0/attn/qkv/kernel' is two float32 tensors named as
the params are in the tree, the path joined with '.':

  * `blocks.0.attn.qkv.kernel_lora_a`: A, (K, rank);
  * `blocks.0.attn.qkv.kernel_lora_b`: B, (rank, N);

with K and N the Q8 param's (K, N) matrix (`q8rules.layout`). The header metadata key
`__q8rules_lora__` holds a JSON object with each adapter's alpha (so a reload restores the
scale alpha / rank), rank, K, N and tensor names:

    {"version": 1, "adapters": {"blocks/0/attn/qkv/kernel": {"alpha": 16.0, "rank": 8,
      "k": 64, "n": 192, "a": "blocks.0.attn.qkv.kernel_lora_a", "b": "..._lora_b"}}}

The module path ('blocks/0/attn/qkv') and param name ('kernel') are those of the tree, so an
exporter can map them to another program's names (PEFT's `lora_A.weight` is A transposed).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.safetensors import user_metadata, write_file
from q8rules.lora.params import Adapters, LoraAdapter
from q8rules.lora.provider import LORA_A, LORA_B
from q8rules.tree_paths import listing

META_KEY = "__q8rules_lora__"
"""Header metadata key of the adapters' alpha, rank, shapes and tensor names (JSON)."""

FORMAT_VERSION = 1


def tensor_names(name: str) -> tuple[str, str]:
  """The tensors of the adapter of the Q8 param `name` ('up/kernel'): ('up.kernel_lora_a',
  'up.kernel_lora_b'). Raises CheckpointError for an empty step or one holding '.'."""
  parts = name.split("/")
  if any(not p or "." in p for p in parts):
    raise CheckpointError(
      f"LoRA adapter of {name}: a path step is empty or holds '.', which tensor names use as"
      " the separator"
    )
  dotted = ".".join(parts)
  return dotted + LORA_A, dotted + LORA_B


def save_lora(
  path: str | os.PathLike[str],
  adapters: Mapping[str, LoraAdapter],
  metadata: Mapping[str, str] | None = None,
) -> None:
  """Write adapters (`q8rules.split_lora`'s) as a safetensors file; `load_lora` gives them back
  bit for bit, alpha included.

  Args:
    path: the .safetensors file (written to a temporary file, then renamed).
    adapters: by the path of the Q8 param each adapts ('up/kernel').
    metadata: str -> str, stored in the header too; the key `__q8rules_lora__` is reserved.

  Raises:
    CheckpointError naming the adapter: no adapters, A or B not float32 (K, r) and (r, N), alpha
    not > 0, a path step holding '.'; a reserved or non-str metadata entry.
  """
  path = Path(path)
  metadata = user_metadata(path, metadata, META_KEY)
  if not adapters:
    raise CheckpointError(f"{path}: no LoRA adapter to save")
  tensors: dict[str, np.ndarray] = {}
  described: dict[str, dict[str, Any]] = {}
  for name, adapter in adapters.items():
    try:
      adapter.check(f"LoRA adapter of {name}")
    except ValueError as e:
      raise CheckpointError(f"{path}: {e}") from None
    a_name, b_name = tensor_names(name)
    a, b = np.asarray(adapter.a, order="C"), np.asarray(adapter.b, order="C")
    tensors[a_name], tensors[b_name] = a, b
    described[name] = {
      "alpha": float(adapter.alpha),
      "rank": adapter.rank,
      "k": int(a.shape[0]),
      "n": int(b.shape[1]),
      "a": a_name,
      "b": b_name,
    }
  metadata[META_KEY] = json.dumps(
    {"version": FORMAT_VERSION, "adapters": described}, sort_keys=True
  )
  write_file(path, tensors, metadata)


def _described(path: Path, metadata: Mapping[str, str] | None) -> dict[str, dict[str, Any]]:
  """The adapters' entries of the header, checked for form."""
  if not metadata or META_KEY not in metadata:
    raise CheckpointError(
      f"{path}: no {META_KEY!r} in the header: not a LoRA file written by q8rules.save_lora"
    )
  try:
    meta = json.loads(metadata[META_KEY])
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: {META_KEY!r} is not JSON: {e}") from None
  if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
    version = meta.get("version") if isinstance(meta, dict) else None
    raise CheckpointError(
      f"{path}: LoRA format version {version!r}; this q8rules reads {FORMAT_VERSION}"
    )
  adapters = meta.get("adapters")
  if not isinstance(adapters, dict) or not adapters:
    raise CheckpointError(f"{path}: {META_KEY!r} lists no adapters")
  for name, entry in adapters.items():
    keys = {"alpha", "rank", "k", "n", "a", "b"}
    if not isinstance(entry, dict) or not keys <= set(entry):
      raise CheckpointError(f"{path}: LoRA adapter of {name}: its entry lacks {sorted(keys)}")
  return adapters


def load_lora(path: str | os.PathLike[str]) -> Adapters:
  """Read adapters written by `save_lora`.

  Returns:
    By Q8 param path ('up/kernel'), `LoraAdapter`s of numpy float32 A (K, r), B (r, N) and the
    alpha they were saved with: for `q8rules.join_lora` (to run them on a base) or
    `q8rules.merge_lora` (to fold them into it).

  Raises:
    CheckpointError naming the file and adapter: not such a file; a tensor missing, or of
    another shape or dtype than its entry says; an alpha not > 0; tensors no entry names.
  """
  path = Path(path)
  try:
    handle = safetensors.safe_open(str(path), framework="numpy")
  except (OSError, safetensors.SafetensorError) as e:
    raise CheckpointError(f"{path}: cannot read it as safetensors: {e}") from e
  with handle as f:
    described = _described(path, f.metadata())
    present = set(f.keys())
    adapters: Adapters = {}
    named: set[str] = set()
    for name, entry in described.items():
      where = f"{path}: LoRA adapter of {name}"
      rank, k, n = entry["rank"], entry["k"], entry["n"]
      parts = {}
      for part, want in (("a", (k, rank)), ("b", (rank, n))):
        tensor = entry[part]
        if tensor not in present:
          raise CheckpointError(f"{where}: tensor {tensor!r} is missing")
        value = f.get_tensor(tensor)
        if tuple(value.shape) != tuple(want) or value.dtype != np.float32:
          raise CheckpointError(
            f"{where}: tensor {tensor!r} is {value.dtype} {tuple(value.shape)}; its entry"
            f" (rank {rank}, K={k}, N={n}) wants float32 {tuple(want)}"
          )
        parts[part] = value
        named.add(tensor)
      alpha = entry["alpha"]
      if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise CheckpointError(f"{where}: alpha {alpha!r} is not a finite number > 0")
      adapters[name] = LoraAdapter(a=parts["a"], b=parts["b"], alpha=float(alpha))
    extra = sorted(present - named)
    if extra:
      raise CheckpointError(f"{path}: tensors no adapter entry names:\n{listing(extra)}")
  return adapters


__all__ = ["META_KEY", "load_lora", "save_lora", "tensor_names"]
