"""Which GGUF tensors a `TransformerConfig` needs, where each goes, and checking a file has them.

`BLOCK_TENSORS` and `MODEL_TENSORS` are the table: llama.cpp's tensor name, the param
path in the `Transformer`, the shape in GGUF numpy order (`[n_out, n_in]` for a
matrix; D dim, Q heads * head_dim, K kv_heads * head_dim, H head_dim, F ffn, V vocab)
and the config that has it. docs/archs.md shows it per arch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from q8rules.checkpoint import CheckpointError
from q8rules.llm.archs import ARCHS
from q8rules.models.config import TransformerConfig
from q8rules.tree_paths import listing


class TensorSlot(NamedTuple):
  """One GGUF tensor the model needs.

  Attributes:
    path: the param path in the Transformer's params: ('layers', 'attn', 'q', 'kernel') for
      a block's tensor when the layers are scanned (stacked along a leading axis), else
      ('layers_0', 'attn', 'q', 'kernel').
    shape: the tensor's shape in GGUF numpy order (`[n_out, n_in]` for a matrix).
    dense: whether it is a matrix the Q8 rules can serve (a Dense kernel, a stack of experts
      (E, N, K), or the embedding table: looked up, and the output projection when tied).
    layer: the block it belongs to (its index along the stacked axis when scanned).
  """

  path: tuple[str, ...]
  shape: tuple[int, ...]
  dense: bool
  layer: int | None = None


Has = Callable[[TransformerConfig], bool]
_ALWAYS: Has = lambda c: True  # noqa: E731


def _mlp(c: TransformerConfig) -> bool:
  """The layers have the dense FFN (`mlp`): no experts, or one beside them (Gemma 4's)."""
  return not c.experts or c.expert_dense_branch


def _experts(c: TransformerConfig) -> bool:
  """The layers have routed experts (`moe`): a router (E, D) and three stacks (E, N, K)."""
  return c.experts > 0


def _fused_experts(c: TransformerConfig) -> bool:
  """The experts' gate and up are one stack (E, 2F, D), gate rows first (`ffn_gate_up_exps`)."""
  return c.experts > 0 and c.expert_fused_gate_up


def _split_experts(c: TransformerConfig) -> bool:
  """The experts' gate and up are stacks of their own (not one `ffn_gate_up_exps`)."""
  return c.experts > 0 and not c.expert_fused_gate_up


BLOCK_TENSORS: tuple[tuple[str, str, tuple[str, ...], Has], ...] = (
  # GGUF name in blk.{i}, param path in the block, shape, which configs have it
  ("attn_norm.weight", "attn_norm/scale", ("D",), _ALWAYS),
  ("attn_q.weight", "attn/q/kernel", ("Q", "D"), lambda c: not c.fused_qkv),
  ("attn_k.weight", "attn/k/kernel", ("K", "D"), lambda c: not c.fused_qkv),
  ("attn_v.weight", "attn/v/kernel", ("K", "D"), lambda c: not c.fused_qkv),
  ("attn_q.bias", "attn/q/bias", ("Q",), lambda c: c.qkv_bias and not c.fused_qkv),
  ("attn_k.bias", "attn/k/bias", ("K",), lambda c: c.qkv_bias and not c.fused_qkv),
  ("attn_v.bias", "attn/v/bias", ("K",), lambda c: c.qkv_bias and not c.fused_qkv),
  ("attn_qkv.weight", "attn/qkv/kernel", ("Q+2K", "D"), lambda c: c.fused_qkv),
  ("attn_qkv.bias", "attn/qkv/bias", ("Q+2K",), lambda c: c.fused_qkv and c.qkv_bias),
  ("attn_q_norm.weight", "attn/q_norm/scale", ("H",), lambda c: c.qk_norm),
  ("attn_k_norm.weight", "attn/k_norm/scale", ("H",), lambda c: c.qk_norm),
  ("attn_output.weight", "attn/o/kernel", ("D", "Q"), _ALWAYS),
  ("attn_output.bias", "attn/o/bias", ("D",), lambda c: c.attn_output_bias),
  ("attn_sinks.weight", "attn/sinks", ("NH",), lambda c: c.attn_sinks),
  ("post_attention_norm.weight", "post_attn_norm/scale", ("D",), lambda c: c.post_norms),
  ("ffn_norm.weight", "mlp_norm/scale", ("D",), _ALWAYS),
  ("ffn_gate.weight", "mlp/gate/kernel", ("F", "D"), lambda c: _mlp(c) and not c.fused_gate_up),
  ("ffn_up.weight", "mlp/up/kernel", ("F", "D"), lambda c: _mlp(c) and not c.fused_gate_up),
  ("ffn_up.weight", "mlp/up/kernel", ("2F", "D"), lambda c: _mlp(c) and c.fused_gate_up),
  ("ffn_down.weight", "mlp/down/kernel", ("D", "F"), _mlp),
  ("ffn_gate_inp.weight", "moe/gate_inp/kernel", ("E", "D"), _experts),  # the router, float
  ("ffn_gate_exps.weight", "moe/gate_exps", ("E", "EF", "D"), _split_experts),
  ("ffn_up_exps.weight", "moe/up_exps", ("E", "EF", "D"), _split_experts),
  ("ffn_down_exps.weight", "moe/down_exps", ("E", "D", "EF"), _experts),
  ("ffn_gate_inp.bias", "moe/gate_inp/bias", ("E",), lambda c: c.expert_router_bias),
  ("ffn_gate_exps.bias", "moe/gate_exps_bias", ("E", "EF"), lambda c: c.expert_bias),
  ("ffn_up_exps.bias", "moe/up_exps_bias", ("E", "EF"), lambda c: c.expert_bias),
  ("ffn_down_exps.bias", "moe/down_exps_bias", ("E", "D"), lambda c: c.expert_bias),
  ("post_ffw_norm.weight", "post_mlp_norm/scale", ("D",), lambda c: c.post_norms),
  ("layer_output_scale.weight", "out_scale", ("1",), lambda c: c.layer_out_scale),
  ("ffn_gate_up_exps.weight", "moe/gate_up_exps", ("E", "2EF", "D"), _fused_experts),
  ("ffn_gate_inp.scale", "moe/gate_inp_scale", ("D",), lambda c: c.expert_router_norm),
  ("ffn_down_exps.scale", "moe/down_exps_scale", ("E",), lambda c: c.expert_down_scale),
  ("post_ffw_norm_1.weight", "post_mlp_norm_1/scale", ("D",), lambda c: c.expert_dense_branch),
  ("pre_ffw_norm_2.weight", "mlp_norm_2/scale", ("D",), lambda c: c.expert_dense_branch),
  ("post_ffw_norm_2.weight", "post_mlp_norm_2/scale", ("D",), lambda c: c.expert_dense_branch),
  ("inp_gate.weight", "ple/gate/kernel", ("P", "D"), lambda c: c.per_layer_dim > 0),
  ("proj.weight", "ple/proj/kernel", ("D", "P"), lambda c: c.per_layer_dim > 0),
  ("post_norm.weight", "ple/norm", ("D",), lambda c: c.per_layer_dim > 0),
)
"""Each block's tensors (a matrix is Q8-servable, a vector is not), under the names an arch's
files give them unless its `Arch.tensor_names` says otherwise."""

MODEL_TENSORS: tuple[tuple[str, str, tuple[str, ...], Has], ...] = (
  ("token_embd.weight", "embed/table", ("V", "D"), _ALWAYS),
  ("output_norm.weight", "norm/scale", ("D",), _ALWAYS),
  ("output.weight", "lm_head/kernel", ("V", "D"), lambda c: not c.tied_embeddings),
  ("rope_freqs.weight", "rope_freqs", ("H/2",), lambda c: c.rope_freq_factors),
  ("rope_factors_long.weight", "rope_factors_long", ("H/2",), lambda c: c.rope_long_short),
  ("rope_factors_short.weight", "rope_factors_short", ("H/2",), lambda c: c.rope_long_short),
  ("per_layer_token_embd.weight", "per_layer/token_embd", ("V", "LP"), lambda c: c.per_layer_dim),
  (
    "per_layer_model_proj.weight",
    "per_layer/per_layer_model_proj/kernel",
    ("LP", "D"),
    lambda c: c.per_layer_dim > 0,
  ),
  ("per_layer_proj_norm.weight", "per_layer/proj_norm", ("P",), lambda c: c.per_layer_dim > 0),
)
"""The tensors outside the blocks."""


def _sizes(c: TransformerConfig) -> dict[str, int]:
  q, k = c.heads * c.head_dim, c.kv_heads * c.head_dim
  return {
    "D": c.dim,
    "Q": q,
    "K": k,
    "Q+2K": q + 2 * k,
    "H": c.head_dim,
    "H/2": c.head_dim // 2,
    "F": c.ffn,
    "2F": 2 * c.ffn,
    "V": c.vocab,
    "NH": c.heads,
    "E": c.experts,
    "EF": c.expert_ffn or c.ffn,
    "1": 1,
    "P": c.per_layer_dim,
    "LP": c.layers * c.per_layer_dim,
    "2EF": 2 * (c.expert_ffn or c.ffn),
  }


NO_KV = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")
"""Tensors a layer that computes no KV (`TransformerConfig.shared_kv_layers`) does not read:
llama.cpp loads them when a file has them and never uses them; `load_gguf` skips them."""
MATRICES = ("token_embd.weight", "output.weight", "per_layer_token_embd.weight")
MATRICES += ("per_layer_model_proj.weight",)
"""The tensors outside the blocks that are matrices a Q8 rule can serve (tables and products)."""


def _in_layer(c: TransformerConfig, i: int, name: str) -> bool:
  """Whether layer i reads block tensor `name` (a layer past `kv_layers` has no K and V; one
  of `layer_k_as_v` no V)."""
  if i >= c.kv_layers and name in NO_KV:
    return False
  return not (name == "attn_v.weight" and c.layer_k_as_v and c.layer_k_as_v[i])


def skipped_tensors(c: TransformerConfig) -> set[str]:
  """The names a file of `c` may have that the model does not read (`NO_KV` of the layers that
  share their KV)."""
  return {f"blk.{i}.{name}" for i in range(c.kv_layers, c.layers) for name in NO_KV}


FLOAT_BLOCK_TENSORS = ("ffn_gate_inp.weight",)
"""Block matrices that stay float (llama.cpp's quantizer keeps routers float)."""


def _file_names(c: TransformerConfig) -> dict[str, str]:
  """A block tensor's name in the table -> its name in the files of `c.arch` (where its arch
  renames it: `Arch.tensor_names`)."""
  arch = ARCHS.get(c.arch)
  return dict(arch.tensor_names) if arch is not None else {}


def tensor_slots(c: TransformerConfig) -> dict[str, TensorSlot]:
  """GGUF name -> TensorSlot for every tensor the model of `c` reads (llama.cpp's names)."""
  size = _sizes(c)
  renamed = _file_names(c)
  slots = {}
  for name, path, shape, has in MODEL_TENSORS:
    if has(c):
      dims = tuple(size[s] for s in shape)
      slots[name] = TensorSlot(tuple(path.split("/")), dims, name in MATRICES)
  for i in range(c.layers):
    layer = "layers" if c.scan_layers else f"layers_{i}"
    size = _sizes(c.layer(i))
    for name, path, shape, has in BLOCK_TENSORS:
      if has(c) and _in_layer(c, i, name):
        dims = tuple(size[s] for s in shape)
        served = len(dims) >= 2 and name.endswith(".weight") and name not in FLOAT_BLOCK_TENSORS
        file_name = renamed.get(name, name)
        slots[f"blk.{i}.{file_name}"] = TensorSlot((layer, *path.split("/")), dims, served, i)
  return slots


def _expert_sizes(c: TransformerConfig) -> str:
  if not c.experts:
    return ""
  return f", experts {c.experts} (expert_count), expert ffn {c.expert_ffn or c.ffn}"


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
  skipped = skipped_tensors(c)
  unexpected = [repr(n) for n in shapes if n not in slots and n not in skipped]
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
      f" ffn {c.ffn}, vocab {c.vocab}{_expert_sizes(c)}):\n{listing(wrong)}"
    )
  if problems:
    raise CheckpointError(
      f"{path}: not a {c.arch!r} model as its metadata describes:\n" + "\n".join(problems)
    )


__all__ = [
  "BLOCK_TENSORS",
  "FLOAT_BLOCK_TENSORS",
  "MODEL_TENSORS",
  "TensorSlot",
  "check_tensors",
  "skipped_tensors",
  "tensor_slots",
]
