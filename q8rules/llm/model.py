"""`GGUFModel`: a loaded GGUF model (`q8rules.llm.load.load_gguf`), ready to run.

    m = q8rules.load_gguf("model-q8_0.gguf", dtype=jnp.float32)
    m.config                        # TransformerConfig from the file's metadata
    m.logits([1, 2, 3])             # (3, vocab) float32, all positions
    m.prefill([1, 2, 3])            # the last position's logits (vocab,) and the KV cache
    m.generate(m.tokenizer.encode("Hello"), 32)   # greedy, with a KV cache

The model is `q8rules.models.Transformer` quantized by `q8rules.Q8Provider`
rules; token ids in, logits out, whether or not the file's tokenizer loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from q8rules.engine.runner import BatchRunner
from q8rules.engine.sampling import SEED_MODULUS, SamplingParams
from q8rules.llm import distributed
from q8rules.llm.generate import CHUNK, history_length, stream_tokens
from q8rules.llm.sources import GGUFSource
from q8rules.llm.unstack import rebuilt, unrolled
from q8rules.lora.convert import merged_params
from q8rules.lora.gguf_file import save_lora_gguf
from q8rules.lora.gguf_model import LoraSpec, adapters_of, with_lora
from q8rules.lora.trainer import check_batch, model_loss
from q8rules.models.transformer import TransformerConfig
from q8rules.providers import shard_products

CACHE_ROUND = 64
"""KV cache lengths are rounded up to a multiple of this (fewer recompilations)."""

RUNNERS = 4
"""The most runners (`GGUFModel.runner`) a model keeps, each with its KV cache: the least
recently used goes when another is made."""

TP_SPECS = {  # Megatron: the PartitionSpecs of one block's float Dense kernels (in, out)
  r".*/attn/(q|k|v)/kernel": P(None, "tp"),
  r".*/attn/(q|k|v)/bias": P("tp"),
  r".*/attn/o/kernel": P("tp", None),
  r".*/mlp/(gate|up)/kernel": P(None, "tp"),
  r".*/mlp/down/kernel": P("tp", None),
  r".*/moe/(gate|up|down)_exps": P("tp", None, None),  # expert parallel: whole experts apart
}
"""Tensor-parallel layout used with `load_gguf(..., mesh=)` (mesh axis 'tp'), per block; a
stack of experts (E, K, N) is split along E (each device holds whole experts, blocked along
their own K), the router replicated."""


def tp_specs(config: TransformerConfig) -> dict[str, P]:
  """`TP_SPECS` for the model of `config`: with scanned layers each spec gets a leading
  (replicated) entry for the stacked layer axis. Fused matrices (q|k|v, gate|up) are not
  matched, so they stay replicated."""
  specs = dict(TP_SPECS)
  if config.fused_gate_up:  # gate | up in one matrix: a column split would mix them; replicated
    specs[r".*/mlp/gate/kernel"] = specs.pop(r".*/mlp/(gate|up)/kernel")
  if not config.scan_layers:
    return specs
  return {key: P(None, *spec) for key, spec in specs.items()}


@dataclasses.dataclass
class GGUFModel:
  """A loaded GGUF model.

  Attributes:
    path: the (first) file.
    config: hyperparameters from the metadata.
    model: the Flax module to apply (quantized by qwix when the file has Q8_0 weights).
    params: its params: `WithAux(Q8Array, Q8How)` for Q8_0 Dense kernels, a bare
      `Q8Array` for a Q8_0 embedding table, numpy-dtype-preserving jax arrays otherwise.
    metadata: the file's key-value metadata.
    tokenizer: a `GGUFTokenizer` when the file's tokenizer could be built, else None
      (`logits` and `generate` take token ids either way).
    mesh: the device mesh the params are sharded over, or None.
    bytes_read: bytes of tensor data this process read from the file at load (on a mesh
      over several processes, its own shards' and the replicated tensors').
    requantized: how many tensors of each file type were requantized to Q8_0 at load
      (e.g. `Counter({'Q5_0': 81, 'Q4_K': 27, 'Q6_K': 9})`; empty for a Q8_0 file).
    lora: the LoRA adapters' `q8rules.lora.gguf_model.LoraSpec` (rank, alpha, targets) when
      `with_lora` or `load_gguf(lora=...)` added them, else None.
    source: the file(s) loaded and where each of their tensors is in `params`
      (`q8rules.llm.sources.GGUFSource`; None for a model not made by `load_gguf`).
    rule: the `Q8Rule` `model` was quantized with (its module paths, scale dtype and
      `act_qtype`), or None when no product is Q8_0.
    provider_type: `Q8Provider` (served) or `Q8QatProvider` (`trainable='qat'`): what a
      rebuilt model (`unrolled()`, `merged()`) is quantized with again.
  """

  path: Any
  config: TransformerConfig
  model: nn.Module
  params: Any
  metadata: dict[str, Any]
  tokenizer: Any = None
  mesh: Any = None
  bytes_read: int = 0
  requantized: Counter[str] = dataclasses.field(default_factory=Counter)
  lora: LoraSpec | None = None
  source: GGUFSource | None = None
  rule: Any = None
  provider_type: Any = None

  def __post_init__(self) -> None:
    self._apply = jax.jit(self.model.apply, donate_argnums=(2,), static_argnames=("last_only",))
    # the products run per layer (inside the scan a kernel has no layer axis): unstacked specs
    self._specs = tp_specs(dataclasses.replace(self.config, scan_layers=False))
    self._runners: dict[tuple[int, int], BatchRunner] = {}  # `stream`'s, compiled once each

  @property
  def product_specs(self) -> dict[str, P]:
    """The per-layer specs `shard_products` splits this model's products by on its mesh."""
    return self._specs

  def unrolled(self) -> GGUFModel:
    """This model with its layers unrolled (no nn.scan): slower to trace and compile, and no
    faster since the scan reads its weights in place (`q8rules.llm.unstack`)."""
    return unrolled(self)

  def with_lora(
    self,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets: Sequence[str] | None = None,
    dropout: float = 0.0,
    seed: int = 0,
  ) -> GGUFModel:
    """This model with trainable LoRA adapters on its Q8_0 weights (`q8rules.lora.gguf_model`).

    Args:
      rank: r of each adapter: A (K, r), B (r, N); at most min(K, N) of every target.
      alpha: the delta `x @ A @ B` is scaled by alpha / rank.
      targets: GGUF tensor kinds to adapt ('attn_q', 'attn_k', 'attn_v', 'attn_output',
        'ffn_gate', 'ffn_up', 'ffn_down'; 'attn_qkv' where the file fuses q | k | v); default
        all seven the file has.
      dropout: dropout rate on x before A while training (`q8rules.lora.trainer`).
      seed: seed of A's He-uniform init (B starts at zero: the model's outputs do not change).

    Returns:
      A GGUFModel whose params hold `<kernel>_lora_a` (L, K, r) and `_lora_b` (L, r, N) float32
      beside each targeted Q8_0 kernel (stacked like it), served by `Q8LoraProvider`.

    Raises:
      ValueError naming the file or tensor: an unknown target, one the file lacks, a target
      that is not Q8_0, a rank above min(K, N), alpha <= 0, adapters already there.
    """
    return with_lora(self, rank=rank, alpha=alpha, targets=targets, dropout=dropout, seed=seed)

  def adapters(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The adapters per GGUF tensor: 'blk.3.attn_q.weight' -> (A (K, r), B (r, N)) float32."""
    return adapters_of(self)

  def merged(self) -> GGUFModel:
    """This model with its adapters merged into their Q8_0 weights (requantized; see
    `q8rules.lora.convert.merged_params`), served as a plain Q8_0 model."""
    config, params = merged_params(self)
    return dataclasses.replace(rebuilt(self, config, params), lora=None)

  def save_lora_gguf(self, path: Any, *, dtype: str = "f32") -> Any:
    """Write the adapters as a llama.cpp LoRA adapter file (`general.type = adapter`, one
    `<tensor>.lora_a` / `.lora_b` pair per adapted tensor in ggml's orientation, F32 or F16;
    `q8rules.lora.gguf_file`), for llama.cpp's `--lora` and `load_gguf(lora=...)`.
    Written to a temporary file, then renamed. Returns the path."""
    arch = self.metadata.get("general.architecture", self.config.arch)
    return save_lora_gguf(path, self.adapters(), arch=arch, alpha=self.lora.alpha, dtype=dtype)

  def loss(
    self, token_ids: Sequence[int] | np.ndarray, mask: Sequence[Any] | np.ndarray | None = None
  ) -> float:
    """Mean next-token cross-entropy of token_ids ((T,) or (B, T)), counted where `mask`
    ((T,) or (B, T), True for a target) is set at the predicted position; all when None
    (`q8rules.lora.trainer.next_token_loss`)."""
    tokens, m = check_batch(token_ids, mask, self.config.vocab)
    if not hasattr(self, "_loss_fn"):
      self._loss_fn = jax.jit(lambda p, t, mk: model_loss(self.model, self.config, p, t, mk))
    if self.mesh is None:
      return float(self._loss_fn(self.params, tokens, m))
    with shard_products(self.mesh, self._specs):
      return float(self._loss_fn(self.params, tokens, m))

  def save_gguf(self, path: Any, *, progress: bool | None = None) -> Any:
    """Write this model as a complete GGUF file llama.cpp loads (`q8rules.llm.save`): the
    source file's metadata and tensors in its order; a tensor whose param still holds what
    the load gave as the file's own bytes, a changed matrix as Q8_0, a changed float tensor
    in the file's float type; with LoRA adapters, the `merged()` model. Written to a temporary
    file, then renamed. Returns the path."""
    from pathlib import Path

    from q8rules.llm.save import save_gguf

    save_gguf(self, path, progress=progress)
    return Path(path)

  def new_cache(self, length: int, batch: int = 1) -> Any:
    """A zero KV cache of `batch` rows of `length` positions, split over the mesh as k / v
    are (`distributed.init_cache_on`)."""
    return distributed.init_cache_on(self.config, length, self.mesh, batch)

  def on_device(self, value: Any, dtype: Any = jnp.int32) -> jax.Array:
    """A host value as a `dtype` array where this model's calls take it: replicated over its
    mesh (a global array, for runs over several processes), else on the default device."""
    return distributed.on_mesh(value, self.mesh, dtype)

  def products(self) -> contextlib.AbstractContextManager[Any]:
    """The context this model's programs are traced in: its products split over its mesh
    (`shard_products`), nothing without one."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return shard_products(self.mesh, self._specs)

  def _run(
    self, tokens: jax.Array, cache: Any, pos: int, last_only: bool = False
  ) -> tuple[jax.Array, Any]:
    variables = {"params": self.params}
    if self.mesh is None:
      return self._apply(variables, tokens, cache, jnp.int32(pos), last_only=last_only)
    # mesh hook (llm/distributed.py): inputs as global arrays, for runs over several processes
    tokens, at = self.on_device(tokens), self.on_device(pos)
    with self.products():
      return self._apply(variables, tokens, cache, at, last_only=last_only)

  def _length(self, length: int) -> int:
    """`length` positions rounded up to a multiple of `CACHE_ROUND` (at most the model's)."""
    if length > self.config.context_length:
      raise ValueError(
        f"{length} positions exceed the model's context length {self.config.context_length}"
      )
    return min(-(-length // CACHE_ROUND) * CACHE_ROUND, self.config.context_length)

  def _cache(self, length: int) -> Any:
    return self.new_cache(self._length(length))

  def runner(self, length: int, history: int, greedy_only: bool = False) -> BatchRunner:
    """The one-slot runner `stream` decodes `length` positions on (its context `length`
    rounded up like a cache), keeping `history` recent ids, `greedy_only` for plain argmax
    decoding (`BatchRunner`'s: the sampler chain left out of its programs): made (and its
    programs compiled) once per context, history and kind, then reused (the `RUNNERS` most
    recently used are kept)."""
    key = (self._length(length), history, greedy_only)
    runner = self._runners.pop(key, None)
    if runner is None:
      runner = BatchRunner(self, 1, key[0], steps=CHUNK, history=history, greedy_only=greedy_only)
    self._runners[key] = runner  # the newest last
    while len(self._runners) > RUNNERS:
      self._runners.pop(next(iter(self._runners)))
    return runner

  def _check_ids(self, ids: Sequence[int] | np.ndarray) -> jax.Array:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"token ids must be a non-empty 1-D sequence of ints, got {arr!r}")
    if arr.min() < 0 or arr.max() >= self.config.vocab:
      raise ValueError(
        f"token ids must lie in [0, {self.config.vocab}), got {arr.min()}..{arr.max()}"
      )
    return jnp.asarray(arr, jnp.int32)[None]

  def logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Logits (T, vocab) float32 at every position of token_ids (T,), one forward pass."""
    tokens = self._check_ids(token_ids)
    out, _ = self._run(tokens, self._cache(tokens.shape[1]), 0)
    return distributed.to_host(out[0]).astype(np.float32)

  def prefill(
    self, token_ids: Sequence[int] | np.ndarray, max_new_tokens: int = 0
  ) -> tuple[jax.Array, Any]:
    """The prompt's forward pass as `stream` runs it: (logits (vocab,) float32 of the last
    position, on the device; the KV cache, room for `max_new_tokens` more). The output head
    runs on the last position only (`Transformer(..., last_only=True)`)."""
    tokens = self._check_ids(token_ids)
    cache = self._cache(tokens.shape[1] + max_new_tokens)
    logits, cache = self._run(tokens, cache, 0, last_only=True)
    return logits[0, -1], cache

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
  ) -> list[int] | str:
    """The file's `tokenizer.chat_template` over `messages` ([{'role': ..., 'content': ...}]),
    rendered and tokenized as llama-cpp-python does (`q8rules.llm.chat`): token ids, or the
    text when `tokenize` is False; `tools` (OpenAI's function entries) reach the template as
    Hugging Face passes them. ChatTemplateError naming the file when it has no template or
    the template fails to render."""
    from q8rules.llm.chat import ChatTemplateError, apply_chat_template

    if self.tokenizer is None:
      raise ChatTemplateError(f"{self.path}: no tokenizer could be built, so no chat template")
    return apply_chat_template(
      self.tokenizer,
      self.metadata,
      messages,
      add_generation_prompt=add_generation_prompt,
      tokenize=tokenize,
      path=self.path,
      tools=tools,
    )

  def stream(
    self,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    on_prefill: Callable[[], None] | None = None,
    sampler: SamplingParams | None = None,
  ) -> Iterator[int]:
    """Yield new token ids: the prompt in one pass, then the decode on the engine's runner
    (`q8rules.llm.generate`: `CHUNK` tokens per device call, yielded as each chunk ends).

    Greedy (argmax) at temperature 0, else sampled from softmax(logits / temperature);
    `sampler` (a `q8rules.engine.sampling.SamplingParams`: top-k, top-p, min-p, penalties,
    logit bias, as llama.cpp's chain) replaces `temperature` and `seed` when given.
    Stops after `max_new_tokens` or after yielding a token in `stop_ids`.
    `on_prefill` is called once the prompt's logits are ready (for timing).
    """
    if max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    sampler = sampler or SamplingParams(temperature=temperature, seed=seed % SEED_MODULUS)
    ids = np.asarray(self._check_ids(prompt_ids)[0])
    runner = self.runner(
      ids.size + max_new_tokens, history_length(sampler), greedy_only=sampler.plain_argmax
    )
    yield from stream_tokens(runner, ids, max_new_tokens, sampler, stop_ids, on_prefill)

  def generate(
    self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, **options: Any
  ) -> list[int]:
    """The new token ids (up to max_new_tokens) after prompt_ids: `stream`'s, as a list;
    `options` are `stream`'s keywords (`temperature`, `seed`, `stop_ids`, `sampler`, ...),
    greedy with none."""
    return list(self.stream(prompt_ids, max_new_tokens, **options))


__all__ = ["TP_SPECS", "GGUFModel", "tp_specs"]
