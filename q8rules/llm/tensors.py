"""Which GGUF tensors a `TransformerConfig` needs, where each goes, and checking a file has them."""

from __future__ import annotations

from typing import Any, NamedTuple

from q8rules.checkpoint import CheckpointError
from q8rules.models.transformer import TransformerConfig
from q8rules.tree_paths import listing


class TensorSlot(NamedTuple):
  """One GGUF tensor the model needs.

  Attributes:
    path: the param path in the Transformer's params: ('layers', 'attn', 'q', 'kernel') for
      a block's tensor when the layers are scanned (stacked along a leading axis), else
      ('layers_0', 'attn', 'q', 'kernel').
    shape: the tensor's shape in GGUF numpy order (`[n_out, n_in]` for a matrix).
    dense: whether it is a matrix the Q8 rules can serve (a Dense kernel, or the
      embedding table: looked up, and the output projection when tied).
    layer: the block it belongs to (its index along the stacked axis when scanned).
  """

  path: tuple[str, ...]
  shape: tuple[int, ...]
  dense: bool
  layer: int | None = None


_LAYER = {  # GGUF name in block i -> (module path under layers_i, leaf)
  "attn_q": ("attn/q", "kernel"),
  "attn_k": ("attn/k", "kernel"),
  "attn_v": ("attn/v", "kernel"),
  "attn_output": ("attn/o", "kernel"),
  "ffn_gate": ("mlp/gate", "kernel"),
  "ffn_up": ("mlp/up", "kernel"),
  "ffn_down": ("mlp/down", "kernel"),
}


def tensor_slots(c: TransformerConfig) -> dict[str, TensorSlot]:
  """GGUF name -> TensorSlot for every tensor the model of `c` reads (llama.cpp's names)."""
  q_out, kv_out = c.heads * c.head_dim, c.kv_heads * c.head_dim
  shapes = {
    "attn_q": (q_out, c.dim),
    "attn_k": (kv_out, c.dim),
    "attn_v": (kv_out, c.dim),
    "attn_output": (c.dim, q_out),
    "ffn_gate": (c.ffn, c.dim),
    "ffn_up": (c.ffn, c.dim),
    "ffn_down": (c.dim, c.ffn),
  }
  slots = {"token_embd.weight": TensorSlot(("embed", "table"), (c.vocab, c.dim), True)}
  for i in range(c.layers):
    layer = "layers" if c.scan_layers else f"layers_{i}"
    per_layer = {
      "attn_norm": ((layer, "attn_norm", "scale"), (c.dim,), False),
      "ffn_norm": ((layer, "mlp_norm", "scale"), (c.dim,), False),
    }
    for name, (module, leaf) in _LAYER.items():
      per_layer[name] = ((layer, *module.split("/"), leaf), shapes[name], True)
    for name, (path, shape, dense) in per_layer.items():
      slots[f"blk.{i}.{name}.weight"] = TensorSlot(path, shape, dense, i)
    if c.qkv_bias:
      for name in ("attn_q", "attn_k", "attn_v"):
        path = (layer, *_LAYER[name][0].split("/"), "bias")
        slots[f"blk.{i}.{name}.bias"] = TensorSlot(path, shapes[name][:1], False, i)
  slots["output_norm.weight"] = TensorSlot(("norm", "scale"), (c.dim,), False)
  if not c.tied_embeddings:
    slots["output.weight"] = TensorSlot(("lm_head", "kernel"), (c.vocab, c.dim), True)
  if c.rope_freq_factors:
    slots["rope_freqs.weight"] = TensorSlot(("rope_freqs",), (c.head_dim // 2,), False)
  return slots


def check_tensors(path: Any, shapes: dict[str, tuple[int, ...]], c: TransformerConfig) -> None:
  """Raise CheckpointError listing every missing tensor, unexpected tensor and wrong shape.

  Args:
    path: the file (for the message).
    shapes: every tensor of the file, name -> shape in GGUF numpy order.
    c: the config read from the file's metadata.
  """
  slots = tensor_slots(c)
  problems = []
  missing = [repr(n) for n in slots if n not in shapes]
  if missing:
    problems.append(f"{len(missing)} tensor(s) missing:\n{listing(missing)}")
  unexpected = [repr(n) for n in shapes if n not in slots]
  if unexpected:
    problems.append(
      f"{len(unexpected)} unexpected tensor(s) (not part of a {c.arch!r} model):\n"
      f"{listing(unexpected)}"
    )
  wrong = [
    f"{n!r}: shape {shapes[n]}, the metadata says {s.shape}"
    for n, s in slots.items()
    if n in shapes and tuple(shapes[n]) != s.shape
  ]
  if wrong:
    problems.append(
      f"{len(wrong)} tensor(s) disagree with the metadata"
      f" (dim {c.dim}, heads {c.heads}, kv heads {c.kv_heads}, head dim {c.head_dim},"
      f" ffn {c.ffn}, vocab {c.vocab}):\n{listing(wrong)}"
    )
  if problems:
    raise CheckpointError(
      f"{path}: not a {c.arch!r} model as its metadata describes:\n" + "\n".join(problems)
    )
