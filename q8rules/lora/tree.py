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
}
"""GGUF tensor kind (`blk.N.<kind>.weight`) -> (block module, Dense module) in the Transformer."""


def layer_roots(config: Any) -> list[str]:
  """The params' block roots: ['layers'] (scanned: stacked) or ['layers_0', ...]."""
  return ["layers"] if config.scan_layers else [f"layers_{i}" for i in range(config.layers)]


def kernel_path(root: str, kind: str) -> tuple[str, str, str, str]:
  block, module = KINDS[kind]
  return (root, block, module, "kernel")


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


__all__ = ["KINDS", "get_in", "kernel_path", "layer_roots", "set_in"]
