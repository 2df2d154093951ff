"""Load-fused groups and LoRA: each layer's q | k | v (gate | up) split back into its members'
params for their own adapters, and fused again after merging.

`load_gguf` concatenates a group's matrices along N into one product (`q8rules.llm.fuse`).
Blocks run along K, so taking a member's columns back out moves no value across a Q8_0 block:
the members' params are the file's int8 values and scales as they are, and each member's
product computes its columns exactly as the fused one did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from q8rules.lora.tree import KINDS, get_in, layer_roots, set_in
from q8rules.providers.q8_weight import Q8Weight

GROUPS = (
  ("attn", "qkv", ("attn_q", "attn_k", "attn_v"), "fused_qkv"),
  ("mlp", "up", ("ffn_gate", "ffn_up"), "fused_gate_up"),
  ("moe", "gate_up_exps", ("ffn_gate_exps", "ffn_up_exps"), "expert_fused_gate_up"),
)
"""Groups `load_gguf` fuses: (block module, fused module, member kinds in column order, config
field). The expert stacks' group is of params of the Moe module (E, K, N), not of modules."""

_PARAMS = {"moe"}
"""Blocks whose group members are params (a stack each) rather than Dense modules."""


def _columns(leaf: Any, start: int, stop: int, name: str) -> Any:
  """Columns [start, stop) of a (..., K, N) param: a Q8 param's values and scales (blocks run
  along K, so no block changes), or a float kernel / bias (last axis)."""
  if isinstance(leaf, Q8Weight):
    arr = leaf.array
    sliced = dataclasses.replace(arr, q=arr.q[..., start:stop], scale=arr.scale[..., start:stop])
    layout = leaf.how.layout
    how = dataclasses.replace(
      leaf.how, layout=dataclasses.replace(layout, shape=(*layout.shape[:-1], stop - start))
    )
    return dataclasses.replace(leaf, array=sliced, how=how, name=name)
  return leaf[..., start:stop]


def _sizes(config: Any) -> dict[str, int]:
  return {
    "attn_q": config.heads * config.head_dim,
    "attn_k": config.kv_heads * config.head_dim,
    "attn_v": config.kv_heads * config.head_dim,
    "ffn_gate": config.ffn,
    "ffn_up": config.ffn,
    "ffn_gate_exps": config.expert_ffn or config.ffn,
    "ffn_up_exps": config.expert_ffn or config.ffn,
  }


def unfuse(
  config: Any, params: Any, targets: Sequence[str], present: set[str]
) -> tuple[Any, Any, tuple[str, ...]]:
  """`config` and `params` with each load-fused group that has a targeted member split back into
  its members (see the module), and the config fields of the groups split. A group the file
  itself fuses stays as it is."""
  sizes, split = _sizes(config), []
  for block, fused, members, field in GROUPS:
    if not getattr(config, field) or not set(members) & set(targets):
      continue
    if not set(members) <= present:  # the file's own fused tensor (phi3): keep it
      continue
    for root in layer_roots(config):
      node = get_in(params, (root, block))
      fused_module = node[fused]
      new_block = {k: v for k, v in node.items() if k != fused}
      start = 0
      for kind in members:
        stop = start + sizes[kind]
        module = KINDS[kind][1]
        if block in _PARAMS:
          new_block[module] = _columns(fused_module, start, stop, f"{root}/{block}/{module}")
        else:
          new_block[module] = {
            leaf: _columns(value, start, stop, f"{root}/{block}/{module}/{leaf}")
            for leaf, value in fused_module.items()
          }
        start = stop
      params = set_in(params, (root, block), new_block)
    config = dataclasses.replace(config, **{field: False})
    split.append(field)
  return config, params, tuple(split)


def _joined(parts: Sequence[Any], name: str) -> Any:
  """The column concatenation of `parts` (Q8 params or float arrays), as one param `name`."""
  first = parts[0]
  if isinstance(first, Q8Weight):
    q = jnp.concatenate([p.array.q for p in parts], axis=-1)
    scale = jnp.concatenate([p.array.scale for p in parts], axis=-1)
    layout = first.how.layout
    n = sum(p.how.layout.shape[-1] for p in parts)
    how = dataclasses.replace(
      first.how, layout=dataclasses.replace(layout, shape=(*layout.shape[:-1], n))
    )
    array = dataclasses.replace(first.array, q=q, scale=scale)
    return dataclasses.replace(first, array=array, how=how, name=name)
  return jnp.concatenate(parts, axis=-1)


def refuse(config: Any, params: Any, fields: Sequence[str]) -> tuple[Any, Any]:
  """The inverse of `unfuse`: the groups of `fields` concatenated back into one param each."""
  for block, fused, members, field in GROUPS:
    if field not in fields:
      continue
    modules = [KINDS[k][1] for k in members]
    for root in layer_roots(config):
      node = get_in(params, (root, block))
      new_block = {k: v for k, v in node.items() if k not in modules}
      if block in _PARAMS:
        new_block[fused] = _joined([node[m] for m in modules], f"{root}/{block}/{fused}")
      else:
        new_block[fused] = {
          leaf: _joined([node[m][leaf] for m in modules], f"{root}/{block}/{fused}/{leaf}")
          for leaf in node[modules[0]]
        }
      params = set_in(params, (root, block), new_block)
    config = dataclasses.replace(config, **{field: True})
  return config, params


__all__ = ["GROUPS", "refuse", "unfuse"]
