"""The `gpt-oss` arch (OpenAI's gpt-oss-20b / -120b; llama.cpp's openai-moe,
src/models/openai-moe.cpp) as `TransformerConfig` fields, read as llama.cpp reads them.

What its graph fixes (`FIELDS`): NEOX rope; q, k, v and the output projection with biases; a
sink logit per head (`attn_sinks`); a mixture of experts whose router has a bias, whose
experts have biases and run gpt-oss's clamped SwiGLU, chosen as the top k of the router's
logits and weighted by the softmax of those k (q8rules/llm/config.py `expert_fields`: gating
'softmax_weight', not normalised); an untied output. Its FFN's norm is stored as
`post_attention_norm` (`tensor_names`).

What it reads besides the keys every arch has (q8rules/llm/config.py):

  attention.sliding_window           required: the window of the local layers
  attention.sliding_window_pattern   default 2: layers 0, 2, 4, ... local (a bool per layer
                                     also read)
  rope.freq_base_swa                 default rope.freq_base; the local layers' scale is the
                                     global one (llama.cpp's rope_freq_scale_train_swa)
  expert_feed_forward_length         the experts' width (feed_forward_length, which
                                     llama.cpp's loader does not need, defaults to it)

The files carry `rope.scaling.type` yarn (factor 32 over 4096 positions), which every arch
reads the same way (q8rules/models/yarn.py); the yarn_beta_* keys are not read, as llama.cpp
reads them for grok and mistral3 only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from q8rules.checkpoint import CheckpointError
from q8rules.llm.arch import Arch, MoeArch, SlidingWindow

NAME = "gpt-oss"
FIELDS: dict[str, Any] = dict(
  rope_style="halves",
  qkv_bias=True,
  attn_output_bias=True,
  attn_sinks=True,
  tied_embeddings=False,
  activation="swiglu_oai",
  expert_router_bias=True,
  expert_bias=True,
)
"""The config fields gpt-oss's graph fixes."""

SWA_PERIOD = 2
"""llama.cpp's `load_swa_pattern(ml, 2)`: layer i is local unless i % 2 == 1."""


def check_keys(meta: Mapping[str, Any], path: str) -> None:
  """CheckpointError naming the key unless the file has a sliding window > 0 and the experts'
  width (llama.cpp's loader requires both; the window and its pattern are then read as every
  arch's, SWA_PERIOD the pattern's default)."""
  key = f"{NAME}.attention.sliding_window"
  window = meta.get(key)
  if window is None or int(window) <= 0:
    why = "it is missing" if window is None else f"it is {window}"
    raise CheckpointError(f"{path}: {NAME} needs {key!r} > 0 (its local layers' window): {why}")
  if meta.get(f"{NAME}.expert_feed_forward_length") is None:
    raise CheckpointError(
      f"{path}: metadata has no '{NAME}.expert_feed_forward_length', which the model needs"
    )


ARCH = Arch(
  NAME,
  FIELDS,
  ffn_key="expert_feed_forward_length",
  sliding_window=SlidingWindow(None, SWA_PERIOD, shared_rope=True),
  experts=MoeArch(gating="softmax_weight", weights_norm=False),
  check=check_keys,
  # its FFN's norm is stored under the name of a post-attention norm
  tensor_names={"ffn_norm.weight": "post_attention_norm.weight"},
)
"""gpt-oss as `q8rules.llm.archs.ARCHS` holds it."""

__all__ = ["ARCH", "FIELDS", "NAME", "SWA_PERIOD", "check_keys"]
