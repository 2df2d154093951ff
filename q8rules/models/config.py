"""`TransformerConfig`: what the one decoder's archs differ in, as fields.

Every field is in llama.cpp's terms where it has them; `q8rules.llm.config` reads them
from a GGUF file's metadata. What each arch sets (llama.cpp's graphs,
src/models/<arch>.cpp) is its module's of q8rules/llm/archs/.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import jax.numpy as jnp

from q8rules.models import yarn

RopeStyle = Literal["interleaved", "halves"]
RopeScaling = Literal["linear", "longrope", "yarn"]
Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]
ExpertGating = Literal["softmax", "sigmoid", "softmax_weight", "sqrt_softplus"]
EXPERT_GATINGS: tuple[str, ...] = get_args(ExpertGating)
"""llama.cpp's expert gating functions (`llama_expert_gating_func_type` 1-4, in order)."""

CHOICES: dict[str, tuple[Any, ...]] = {
  "rope_style": get_args(RopeStyle),
  "rope_scaling": (None, *get_args(RopeScaling)),
  "activation": get_args(Activation),
  "expert_gating": EXPERT_GATINGS,
}
"""The fields that take one of a few values, with those values."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters, in llama.cpp's terms where it has them.

  Attributes:
    arch: the GGUF `general.architecture` this config mirrors ('llama', 'qwen2', ...).
    vocab: tokens in the vocabulary (columns of the embedding table).
    dim: embedding length.
    layers: blocks.
    heads: query heads.
    kv_heads: key/value heads (GQA: `heads % kv_heads == 0`).
    head_dim: per-head width (even; need not be dim / heads).
    ffn: feed-forward width.
    rope_base: RoPE frequency base (theta) of the global layers.
    rope_style: 'interleaved' (llama.cpp NORM) or 'halves' (NEOX).
    rope_scaling: None, 'linear', 'longrope' or 'yarn' (ggml's YaRN: q8rules/models/yarn.py).
    rope_factor: positions are divided by it on global layers (llama.cpp's
      1 / freq_scale) unless rope_scaling is None; with 'yarn' the low frequencies only.
    rope_freq_factors: the model has a `rope_freqs` param (head_dim / 2,)
      dividing each pair's frequency (Llama 3.1's).
    rope_long_short: the model has `rope_factors_long` and `rope_factors_short`
      params (head_dim / 2,) (Phi-3's LongRoPE): a KV cache longer than
      `rope_original_context` uses the long ones, as llama.cpp picks by its n_ctx.
    rope_original_context: the context the model was trained at before
      scaling (`rope.scaling.original_context_length`).
    rope_attn_factor: cos and sin are multiplied by it (llama.cpp's attn_factor; with 'yarn'
      also by YaRN's 1 + 0.1 ln(factor)).
    rope_yarn_beta_fast, rope_yarn_beta_slow: YaRN's correction dims (llama.cpp's
      yarn_beta_fast / yarn_beta_slow).
    norm_eps: RMSNorm epsilon.
    context_length: the longest cache `init_cache` may be asked for.
    tied_embeddings: the output projection is the embedding table.
    qkv_bias: q, k and v have biases.
    attn_output_bias: the attention's output projection has a bias.
    attn_sinks: each head has a learned sink logit (param `sinks` (heads,)), one more term
      of its softmax's denominator (llama.cpp's attn_sinks, gpt-oss's).
    qk_norm: q and k are RMS-normalized per head (weights (head_dim,)) before RoPE.
    post_norms: the attention and FFN outputs are RMS-normalized before their residual add.
    embed_scale: the embeddings are multiplied by sqrt(dim).
    activation: the FFN gate's activation, 'silu' (SwiGLU), 'gelu_tanh' (GeGLU) or
      'swiglu_oai' (gpt-oss's clamped SwiGLU, `q8rules.models.moe.gated`).
    head_dim_local: the local layers' head width (llama.cpp's key_length_swa); 0: head_dim.
    layer_kv_heads: per layer, its KV heads (() : kv_heads everywhere); one value per kind of
      layer among the layers that compute KV (each kind has one KV cache).
    layer_ffn: per layer, its FFN width (() : ffn everywhere).
    layer_k_as_v: per layer, whether it has no v projection: V is K's projection (before K's
      norm), Gemma 4's attention_k_eq_v.
    v_norm: V is RMS-normalized per head, without a weight (Gemma 4's).
    shared_kv_layers: the last this many layers compute no K and V: a local one attends over
      the KV of layer `kv_layers - 2`, a global one over that of layer `kv_layers - 1`
      (llama.cpp's n_layer_kv_from_start; Gemma 4 E2B / E4B); the KV cache holds only the
      layers that compute KV.
    per_layer_dim: the per-layer embeddings' width (Gemma 4's n_embd_per_layer;
      q8rules/models/per_layer.py); 0: none.
    layer_out_scale: each layer's output is multiplied by a learned scalar (param `out_scale`
      (1,), llama.cpp's layer_output_scale).
    expert_dense_branch: with `experts`, the dense FFN runs beside them (Gemma 4 26B-A4B's):
      mlp_norm -> mlp -> post_mlp_norm_1 plus mlp_norm_2 -> moe -> post_mlp_norm_2, the
      router reading the block's residual (`expert_router_norm`).
    expert_router_norm: the router reads rms_norm(x) / sqrt(dim) * `gate_inp_scale` (dim,)
      (Gemma 4's), not the experts' input.
    expert_down_scale: each expert's output is multiplied by its own scale (param
      `down_exps_scale` (E,), llama.cpp's ffn_down_exps.scale).
    fused_qkv: q, k and v come from one matrix (dim -> q | k | v).
    fused_gate_up: gate and up come from one matrix (dim -> gate | up), named 'up'.
    attn_scale: the attention scores' scale; None is 1 / sqrt(head_dim).
    attn_softcap: scores become cap * tanh(scores / cap) before the mask (0: off).
    final_softcap: logits become cap * tanh(logits / cap) (0: off).
    sliding_window: a local layer's query at p sees keys at (p - window, p].
    local_layers: per layer, whether it is a sliding-window layer (() or all False: none).
    rope_base_local: the local layers' RoPE base.
    rope_factor_local: positions are divided by it on local layers.
    experts: routed experts per layer (llama.cpp's n_expert); 0: the dense FFN (`Mlp`), else
      the mixture of experts (`q8rules.models.moe.Moe`, llama.cpp's `build_moe_ffn`).
    experts_used: experts each token is routed to (n_expert_used, top-k), 1 to `experts`.
    expert_ffn: an expert's FFN width (n_ff_exp); 0: `ffn`.
    expert_gating: the router's probabilities: 'softmax', 'sigmoid', 'sqrt_softplus' (of the
      logits, before top-k) or 'softmax_weight' (top-k of the logits, softmax over the k chosen).
    expert_weights_norm: the k chosen weights are divided by their sum (norm_w).
    expert_weights_scale: the chosen weights are multiplied by it (0 or 1: not).
    expert_probs_bias: a param `exp_probs_b` (E,) is added to the probabilities to choose the
      experts only (DeepSeek V3's); the weights are the unbiased probabilities.
    expert_router_bias: the router has a bias (`ffn_gate_inp.bias`).
    expert_bias: each expert's gate, up and down have a bias, params (E, N).
    expert_weights_before_ffn: the weights scale each expert's input instead of its output
      (Llama 4's).
    expert_fused_gate_up: the experts' gate and up are one stack (E, dim, 2F), gate columns
      first (`ffn_gate_up_exps`).
    shared_expert_ffn: width of the shared experts' FFN, run on every token and added
      (n_ff_shexp); 0: none.
    shared_expert_gate: the shared experts' output is scaled by sigmoid(x @ gate_inp_shexp).
    scan_layers: run the blocks under `nn.scan` (params stacked along a
      leading layer axis, under 'layers') instead of unrolled ('layers_i').
    scan_in_place: with `scan_layers`, a scan step gets layer i of the stacked params by
      index (`q8rules.models.hooks.take_layer`; under a q8rules provider Q8_0 weights as
      `LayerSlice`s, which the native CPU kernel reads in place) instead of `nn.scan`
      slicing (copying) every param; False: `nn.scan`'s slices. Init stacks the params the same way either way.
    dtype: activation dtype (float32 or bfloat16); softmax and norms run in
      float32, logits come back float32.
  """

  arch: str = "llama"
  vocab: int = 256
  dim: int = 64
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 16
  ffn: int = 128
  rope_base: float = 10000.0
  rope_style: RopeStyle = "interleaved"
  rope_scaling: RopeScaling | None = None
  rope_factor: float = 1.0
  rope_freq_factors: bool = False
  rope_long_short: bool = False
  rope_original_context: int = 0
  rope_attn_factor: float = 1.0
  rope_yarn_beta_fast: float = yarn.BETA_FAST
  rope_yarn_beta_slow: float = yarn.BETA_SLOW
  norm_eps: float = 1e-5
  context_length: int = 2048
  tied_embeddings: bool = False
  qkv_bias: bool = False
  attn_output_bias: bool = False
  attn_sinks: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  embed_scale: bool = False
  activation: Activation = "silu"
  head_dim_local: int = 0
  layer_kv_heads: tuple[int, ...] = ()
  layer_ffn: tuple[int, ...] = ()
  layer_k_as_v: tuple[bool, ...] = ()
  v_norm: bool = False
  shared_kv_layers: int = 0
  per_layer_dim: int = 0
  layer_out_scale: bool = False
  expert_dense_branch: bool = False
  expert_router_norm: bool = False
  expert_down_scale: bool = False
  fused_qkv: bool = False
  fused_gate_up: bool = False
  attn_scale: float | None = None
  attn_softcap: float = 0.0
  final_softcap: float = 0.0
  sliding_window: int = 0
  local_layers: tuple[bool, ...] = ()
  rope_base_local: float = 10000.0
  rope_factor_local: float = 1.0
  experts: int = 0
  experts_used: int = 0
  expert_ffn: int = 0
  expert_gating: ExpertGating = "softmax"
  expert_weights_norm: bool = False
  expert_weights_scale: float = 0.0
  expert_probs_bias: bool = False
  expert_router_bias: bool = False
  expert_bias: bool = False
  expert_weights_before_ffn: bool = False
  expert_fused_gate_up: bool = False
  shared_expert_ffn: int = 0
  shared_expert_gate: bool = False
  scan_layers: bool = True
  scan_in_place: bool = True
  dtype: Any = jnp.float32

  def __post_init__(self) -> None:
    if self.heads % self.kv_heads:
      raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
    for field, allowed in CHOICES.items():
      if getattr(self, field) not in allowed:
        *first, last = map(repr, allowed)
        raise ValueError(
          f"{field} must be {', '.join(first)} or {last}, got {getattr(self, field)!r}"
        )
    if self.rope_scaling == "yarn" and self.rope_original_context <= 0:
      raise ValueError("rope_scaling 'yarn' needs rope_original_context > 0")
    if self.rope_freq_factors and self.rope_long_short:
      raise ValueError("rope_freq_factors and rope_long_short exclude each other")
    object.__setattr__(self, "local_layers", tuple(bool(b) for b in self.local_layers))
    self._check_layers()
    if self.local_layers and len(self.local_layers) != self.layers:
      raise ValueError(
        f"local_layers has {len(self.local_layers)} entries for {self.layers} layers"
      )
    if any(self.local_layers) and self.sliding_window <= 0:
      raise ValueError(f"local layers need a sliding_window > 0, got {self.sliding_window}")
    self._check_experts()

  def _check_experts(self) -> None:
    if self.experts < 0 or self.expert_ffn < 0 or self.shared_expert_ffn < 0:
      raise ValueError(
        f"experts {self.experts}, expert_ffn {self.expert_ffn} and shared_expert_ffn"
        f" {self.shared_expert_ffn} must be >= 0"
      )
    if self.experts and not 1 <= self.experts_used <= self.experts:
      raise ValueError(f"experts_used {self.experts_used} must be in [1, experts {self.experts}]")
    if not self.experts and self.experts_used:
      raise ValueError(f"experts_used {self.experts_used} without experts")

  @property
  def is_local(self) -> tuple[bool, ...]:
    """Per layer: a sliding-window layer (all False when there are none)."""
    return self.local_layers if any(self.local_layers) else (False,) * self.layers

  @property
  def cache_slots(self) -> tuple[int, ...]:
    """Per layer: its index in the KV cache of its kind (local or global); a layer that shares
    its KV (`shared_kv_layers`), its source's."""
    seen = {True: 0, False: 0}
    slots: list[int] = []
    for i, local in enumerate(self.is_local):
      if i >= self.kv_layers:
        slots.append(slots[self.kv_source(i)])
        continue
      slots.append(seen[local])
      seen[local] += 1
    return tuple(slots)

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """The kinds of layer present, in cache order: 'global' and / or 'local'."""
    return tuple(k for k, here in (("global", False), ("local", True)) if here in self.is_local)

  def _check_layers(self) -> None:
    """The per-layer fields: one entry per layer, heads that divide, one KV shape per kind of
    cache, shared layers whose source is of their kind, unrolled layers where they differ."""
    if self.local_layers and len(self.local_layers) != self.layers:
      return  # __post_init__ says so
    for name in ("layer_kv_heads", "layer_ffn", "layer_k_as_v"):
      value = getattr(self, name)
      object.__setattr__(self, name, tuple(value))
      if value and len(value) != self.layers:
        raise ValueError(f"{name} has {len(value)} entries for {self.layers} layers")
    if self.head_dim_local % 2:
      raise ValueError(f"head_dim_local {self.head_dim_local} must be even (RoPE rotates pairs)")
    if not 0 <= self.shared_kv_layers <= self.layers - 2 * (self.shared_kv_layers > 0):
      raise ValueError(
        f"shared_kv_layers {self.shared_kv_layers} of {self.layers} layers: at least two must"
        " compute their KV"
      )
    for i in range(self.layers):
      if self.heads % self.layer_kv_heads_of(i):
        raise ValueError(
          f"layer {i}: heads {self.heads} is not a multiple of {self.layer_kv_heads_of(i)} KV heads"
        )
      if self.is_local[self.kv_source(i)] != self.is_local[i]:
        raise ValueError(
          f"layer {i} would share the KV of layer {self.kv_source(i)}, a layer of another kind"
        )
    for kind, local in (("global", False), ("local", True)):
      heads = {
        self.layer_kv_heads_of(i) for i in range(self.kv_layers) if self.is_local[i] == local
      }
      if len(heads) > 1:
        raise ValueError(f"the {kind} layers have different KV heads {sorted(heads)}: one cache")
    if self.scan_layers and not self.uniform_layers:
      raise ValueError(
        "layers of different widths, shared KV or per-layer embeddings run unrolled:"
        " scan_layers=False"
      )

  @property
  def uniform_layers(self) -> bool:
    """Whether every layer has the same params and shapes (the layers can be scanned)."""
    widths = {(self.layer_head_dim(i), self.layer_kv_heads_of(i)) for i in range(self.layers)}
    return (
      len(widths) == 1
      and len(set(self.layer_ffn)) <= 1
      and len(set(self.layer_k_as_v)) <= 1
      and not self.shared_kv_layers
      and not self.per_layer_dim
    )

  @property
  def kv_layers(self) -> int:
    """The first this many layers compute K and V; the rest share them (`shared_kv_layers`)."""
    return self.layers - self.shared_kv_layers

  def kv_source(self, i: int) -> int:
    """The layer whose KV layer i attends over: i itself, or for a shared layer llama.cpp's
    choice, `kv_layers - 2` (local) or `kv_layers - 1` (global)."""
    if i < self.kv_layers:
      return i
    return self.kv_layers - (2 if self.is_local[i] else 1)

  def layer_head_dim(self, i: int) -> int:
    """Layer i's head width."""
    return self.head_dim_local if self.is_local[i] and self.head_dim_local else self.head_dim

  def layer_kv_heads_of(self, i: int) -> int:
    """Layer i's KV heads."""
    return self.layer_kv_heads[i] if self.layer_kv_heads else self.kv_heads

  def layer(self, i: int) -> TransformerConfig:
    """Layer i's config: this one with its head width, KV heads and FFN width as the plain
    fields `head_dim`, `kv_heads`, `ffn` (itself when the layers are uniform)."""
    if not (self.head_dim_local or self.layer_kv_heads or self.layer_ffn):
      return self
    return dataclasses.replace(
      self,
      head_dim=self.layer_head_dim(i),
      kv_heads=self.layer_kv_heads_of(i),
      ffn=self.layer_ffn[i] if self.layer_ffn else self.ffn,
      head_dim_local=0,
      layer_kv_heads=(),
      layer_ffn=(),
    )

  def cache_dims(self, kind: str) -> tuple[int, int, int]:
    """(layers, KV heads, head width) of the KV cache of `kind` ('global' or 'local'): the
    layers of that kind that compute KV."""
    local = kind == "local"
    held = [i for i in range(self.kv_layers) if self.is_local[i] == local]
    return len(held), self.layer_kv_heads_of(held[0]), self.layer_head_dim(held[0])


__all__ = [
  "CHOICES",
  "EXPERT_GATINGS",
  "Activation",
  "ExpertGating",
  "RopeScaling",
  "RopeStyle",
  "TransformerConfig",
]
