"""Fusing each layer's q | k | v and gate | up matrices (and its experts' gate | up stacks) at load:
one product each, not 3 and 2.

llama.cpp stores `attn_q`, `attn_k`, `attn_v` (and `ffn_gate`, `ffn_up`) apart; the
`Transformer` can take them as one matrix (`fused_qkv`, `fused_gate_up`: the output axis is
q | k | v, gate | up, split after the product). Concatenating along the output axis N moves
no value across a Q8_0 block (blocks run along K), so the fused Q8_0 matrix holds the file's
int8 values and scales as they are, and each output column is computed exactly as before.
A decode step then runs 4 products a layer instead of 7: fewer kernel calls, and wider ones
(SmolLM-135M's gate | up is 576 x 3072, where the native kernel streams whole rows).

A group is fused when every member is in the file with one tensor type (all Q8_0, or all of
one plain type) and the blocks are scanned (stacked); not on a mesh (a fused matrix's column
split would mix q with k and v, gate with up: `tp_specs` keeps fused matrices replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from q8rules.llm.stacked import slot_name
from q8rules.llm.tensors import TensorSlot
from q8rules.models.config import TransformerConfig

QKV = ("attn", "qkv", ("q", "k", "v"), "fused_qkv", ("kernel", "bias"))
GATE_UP = ("mlp", "up", ("gate", "up"), "fused_gate_up", ("kernel", "bias"))
EXPERTS_GATE_UP = ("moe", "gate_up_exps", ("gate_exps", "up_exps"), "expert_fused_gate_up", (None,))
"""(block module, fused module or param, members in output order, the config field, the
leaves of each: a Dense's kernel and bias, or the param itself (an expert stack (E, K, N),
fused along N: each expert's gate columns, then its up columns))."""


@dataclasses.dataclass(frozen=True)
class Fusion:
  """What `plan` fused.

  Attributes:
    config: the model's config (`fused_qkv` / `fused_gate_up` set for the groups fused).
    slots: fused slot name ('layers/attn/qkv/kernel') -> its members' slot names, in
      output order ('layers/attn/q/kernel', 'layers/attn/k/kernel', ...), for
      `StackedTensors(..., fused=...)`.
  """

  config: TransformerConfig
  slots: dict[str, tuple[str, ...]]


def plan(ckpt: Any, config: TransformerConfig, slots: Mapping[str, TensorSlot]) -> Fusion:
  """The groups of `config`'s blocks that can be fused in `ckpt` (see the module).

  Args:
    ckpt: the GGUF checkpoint (`served_type`).
    config: the config read from the file (scanned blocks: `scan_layers`).
    slots: GGUF name -> TensorSlot for `config` (`tensor_slots`).
  """
  fusion = Fusion(config, {})
  if not config.scan_layers:
    return fusion
  by_path: dict[tuple[str, ...], list[str]] = {}
  for name, slot in slots.items():
    if slot.layer is not None:
      by_path.setdefault(slot.path, []).append(name)
  for block, fused, members, field, leaves in (QKV, GATE_UP, EXPERTS_GATE_UP):
    if getattr(config, field) or (field == EXPERTS_GATE_UP[3] and config.expert_bias):
      continue  # the experts' (N, E) biases would not concatenate along N
    groups = {}
    for leaf in leaves:
      tail = (leaf,) if leaf else ()
      paths = [("layers", block, m, *tail) for m in members]
      present = [p in by_path for p in paths]
      if not any(present):
        continue
      names = [n for p in paths if p in by_path for n in by_path[p]]
      if not all(present) or len({ckpt.served_type(n) for n in names}) != 1:
        groups = {}
        break
      groups[("layers", block, fused, *tail)] = tuple(paths)
    if ("layers", block, fused, *((leaves[0],) if leaves[0] else ())) not in groups:
      continue
    config = dataclasses.replace(config, **{field: True})
    for path, parts in groups.items():
      fusion.slots[slot_name(path)] = tuple(slot_name(p) for p in parts)
  return dataclasses.replace(fusion, config=config)


def fused_paths(paths: list[tuple[str, ...]], fusion: Fusion) -> list[tuple[str, ...]]:
  """Param paths of the file's model (`paths`) as the fused model has them: each fused
  group's member kernels (or expert stacks) replaced by the fused one."""
  out = list(paths)
  for fused, members in fusion.slots.items():
    kernels = [tuple(m.split("/")) for m in members]
    if all(k in out for k in kernels):
      out = [p for p in out if p not in kernels] + [tuple(fused.split("/"))]
  return out


__all__ = ["EXPERTS_GATE_UP", "GATE_UP", "QKV", "Fusion", "fused_paths", "plan"]
