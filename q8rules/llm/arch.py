"""`Arch`: what one GGUF architecture declares, so that the generic reader
(`q8rules.llm.config.config_from_metadata`) and the generic tensor table
(`q8rules.llm.tensors`) hold no arch's name.

An arch is a module of `q8rules/llm/archs/` that builds one `Arch` and is registered in
`q8rules.llm.archs.ARCHS` (docs/archs.md shows how to add one). The keys every arch has
(`embedding_length`, `block_count`, `attention.head_count`, rope, ...) are read by the generic
reader; an `Arch` says what its llama.cpp graph fixes (`fields`), which of its keys llama.cpp
reads besides those (`sliding_window`, `experts`, `read`), what it checks (`check`) and which of
its tensors go by another name than the table's (`tensor_names`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

Metadata = Mapping[str, Any]
"""A GGUF file's key-value metadata (`GGUFCheckpoint.metadata`)."""

ReadFields = Callable[[Metadata, str, dict[str, Any], Mapping[str, Any]], dict[str, Any]]
"""(metadata, the file for messages, the config fields read so far, the file's tensor names)
-> more `TransformerConfig` fields; raises `CheckpointError` naming the key."""

CheckKeys = Callable[[Metadata, str], None]
"""(metadata, the file for messages) -> None, or `CheckpointError` naming the key."""


class SlidingWindow(NamedTuple):
  """An arch with sliding-window layers read as llama.cpp's `load_swa_pattern` reads them.

  Attributes:
    window: llama.cpp's default `attention.sliding_window`; None: without the key every layer
      is global.
    period: the default `attention.sliding_window_pattern`: layer i is local unless
      i % period == period - 1.
    shared_rope: the local layers take the global layers' scale and, by default, their base
      (llama.cpp's rope_freq_scale_train_swa = rope_freq_scale_train); False: base
      `rope.freq_base_swa` (default 10000) and no scaling.
  """

  window: int | None
  period: int
  shared_rope: bool = False


class MoeArch(NamedTuple):
  """What an arch's graph fixes of its experts (llama.cpp's `build_moe_ffn` arguments).

  Attributes:
    gating: the gating function the graph passes ('softmax', ...).
    weights_norm: the graph's `norm_w`.
    own_ffn: the experts' width is `expert_feed_forward_length` (absent: feed_forward_length
      / expert_used_count, as qwen3moe's loader); False: `feed_forward_length` (llama's).
    required: a file of the arch must have experts (qwen3moe); False: experts when
      `expert_count` > 0 (llama: Mixtral-style `ffn_*_exps`).
  """

  gating: str = "softmax"
  weights_norm: bool = True
  own_ffn: bool = True
  required: bool = True


@dataclasses.dataclass(frozen=True)
class Arch:
  """One GGUF architecture: its `general.architecture` and what differs from the generic read.

  Attributes:
    name: `general.architecture` (and the prefix of its keys: `{name}.block_count`).
    fields: the `TransformerConfig` fields its llama.cpp graph fixes (rope style, biases,
      norms, activation, ...).
    layer_arrays: the keys (without the prefix) a file may give one value per layer of
      (llama.cpp's get_key_or_arr); the generic reader takes the first, `read` the rest.
    ffn_key: where `feed_forward_length` is absent, the key whose value it takes (None:
      llama.cpp's 0 in an arch whose experts have their own width, else required).
    sliding_window: its sliding-window layers, read by the generic reader (None: none, or
      read by `read` itself).
    experts: its experts, read by `q8rules.llm.config.expert_fields` (None: no experts, or
      read by `read` itself).
    check: run on the metadata after the common keys (keys llama.cpp's loader requires).
    read: the fields from its own keys and tensors, run last.
    tensor_names: a block tensor's name in the generic table -> its name in this arch's files.
  """

  name: str
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  layer_arrays: tuple[str, ...] = ()
  ffn_key: str | None = None
  sliding_window: SlidingWindow | None = None
  experts: MoeArch | None = None
  check: CheckKeys | None = None
  read: ReadFields | None = None
  tensor_names: Mapping[str, str] = dataclasses.field(default_factory=dict)


__all__ = ["Arch", "CheckKeys", "Metadata", "MoeArch", "ReadFields", "SlidingWindow"]
