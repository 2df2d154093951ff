"""The GGUF model's param tree as LoRA sees it: which module each GGUF tensor kind is, where a
layer's params sit (stacked under the scan, or per layer), and nested-dict get / set."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

KINDS: dict[str, tuple[str, str]] = {
  "attn_q": ("attn", "q"),
  "attn_k": ("attn", "k"),
  "attn_v": ("attn", "v"),
  "attn_qkv": ("attn", "qkv"),
  "attn_output": ("attn", "o"),
  "ffn_gate": ("mlp", "gate"),
  "ffn_up": ("mlp", "up"),
  "ffn_down": ("mlp", "down"),
  "ffn_gate_exps": ("moe", "gate_exps"),
  "ffn_up_exps": ("moe", "up_exps"),
  "ffn_gate_up_exps": ("moe", "gate_up_exps"),
  "ffn_down_exps": ("moe", "down_exps"),
}
"""GGUF tensor kind (`blk.N.<kind>.weight`) -> (block module, Dense module) in the Transformer;
for an expert stack (`EXPERT_KINDS`), (block module, its param): the Moe module holds the
stacks (E, K, N) as params of its own."""

EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")
"""The kinds that are stacks of experts: one adapter per expert, A (E, K, rank), B (E, rank, N),
as llama.cpp's adapter files hold them (`lora_a` ggml [n_in, rank, n_expert])."""


def layer_roots(config: Any) -> list[str]:
  """The params' block roots: ['layers'] (scanned: stacked) or ['layers_0', ...]."""
  return ["layers"] if config.scan_layers else [f"layers_{i}" for i in range(config.layers)]


def kernel_path(root: str, kind: str) -> tuple[str, ...]:
  """The path of the param `kind` adapts under the layer root `root`: the Dense module's
  kernel, or the Moe module's stack."""
  block, module = KINDS[kind]
  return (root, block, module) if kind in EXPERT_KINDS else (root, block, module, "kernel")


def get_in(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
  node: Any = tree
  for key in path:
    node = node[key]
  return node


def set_in(tree: dict[str, Any], path: Sequence[str], value: Any) -> dict[str, Any]:
  """A copy of the nested dicts along `path` with the leaf set (other branches shared)."""
  out = dict(tree)
  if len(path) == 1:
    out[path[0]] = value
    return out
  out[path[0]] = set_in(dict(out.get(path[0], {})), path[1:], value)
  return out


__all__ = ["EXPERT_KINDS", "KINDS", "get_in", "kernel_path", "layer_roots", "set_in"]
