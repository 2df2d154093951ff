"""`load_gguf`: a llama.cpp GGUF model as a Flax module with Q8_0 params, ready to run.

    m = q8rules.load_gguf("model-q8_0.gguf", dtype=jnp.float32)
    m.config                        # TransformerConfig from the file's metadata
    m.logits([1, 2, 3])             # (3, vocab) float32, all positions
    m.generate(m.tokenizer.encode("Hello"), 32)   # greedy, with a KV cache

Every Q8_0 tensor stays a `Q8Array` (int8 values, the file's float16 scales):
the Dense kernels are served by `q8rules.Q8Provider` rules made for exactly
the modules whose weight is Q8_0 in the file; the embedding table, Q8_0 or
not, is looked up column by column and, when the embeddings are tied, is the
output projection too. F32 / F16 / BF16 tensors keep their dtype.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix

from q8rules.checkpoint import assign as ckpt_assign
from q8rules.checkpoint._common import CheckpointError
from q8rules.checkpoint.gguf import PLAIN_TYPES, Q8_0
from q8rules.checkpoint.gguf_split import open_gguf
from q8rules.llm.config import config_from_metadata
from q8rules.llm.tensors import check_tensors, tensor_slots
from q8rules.models.transformer import Transformer, TransformerConfig, init_cache
from q8rules.providers import Q8Provider, shard_products
from q8rules.q8_0 import Q8Array
from q8rules.rules import Q8Rule
from q8rules.sharding import param_shardings

CACHE_ROUND = 64
"""KV cache lengths are rounded up to a multiple of this (fewer recompilations)."""

TP_SPECS = {  # Megatron: the PartitionSpecs of the float Dense kernels (in, out)
  r".*/attn/(q|k|v)/kernel": jax.sharding.PartitionSpec(None, "tp"),
  r".*/attn/(q|k|v)/bias": jax.sharding.PartitionSpec("tp"),
  r".*/attn/o/kernel": jax.sharding.PartitionSpec("tp", None),
  r".*/mlp/(gate|up)/kernel": jax.sharding.PartitionSpec(None, "tp"),
  r".*/mlp/down/kernel": jax.sharding.PartitionSpec("tp", None),
}
"""Tensor-parallel layout used with `load_gguf(..., mesh=)` (mesh axis 'tp')."""


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
    tokenizer: a `GGUFTokenizer` when the file has `tokenizer.ggml.*`, else None.
    mesh: the device mesh the params are sharded over, or None.
  """

  path: Any
  config: TransformerConfig
  model: nn.Module
  params: Any
  metadata: dict[str, Any]
  tokenizer: Any = None
  mesh: Any = None

  def __post_init__(self) -> None:
    self._apply = jax.jit(self.model.apply, donate_argnums=(2,))

  def _run(self, tokens: jax.Array, cache: Any, pos: int) -> tuple[jax.Array, Any]:
    variables = {"params": self.params}
    if self.mesh is None:
      return self._apply(variables, tokens, cache, jnp.int32(pos))
    with shard_products(self.mesh, TP_SPECS):
      return self._apply(variables, tokens, cache, jnp.int32(pos))

  def _cache(self, length: int) -> Any:
    if length > self.config.context_length:
      raise ValueError(
        f"{length} positions exceed the model's context length {self.config.context_length}"
      )
    rounded = min(-(-length // CACHE_ROUND) * CACHE_ROUND, self.config.context_length)
    return init_cache(self.config, rounded)

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
    return np.asarray(out[0], np.float32)

  def stream(
    self,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    on_prefill: Callable[[], None] | None = None,
  ) -> Iterator[int]:
    """Yield new token ids one at a time: the prompt in one pass, then one token a step.

    Greedy (argmax) at temperature 0, else sampled from softmax(logits / temperature).
    Stops after `max_new_tokens` or after yielding a token in `stop_ids`.
    `on_prefill` is called once the prompt's logits are ready (for timing).
    """
    tokens = self._check_ids(prompt_ids)
    t = tokens.shape[1]
    cache = self._cache(t + max_new_tokens)
    key = jax.random.key(seed)
    logits, cache = self._run(tokens, cache, 0)
    last = logits[0, -1]
    last.block_until_ready()
    if on_prefill is not None:
      on_prefill()
    for i in range(max_new_tokens):
      if temperature > 0:
        key, sub = jax.random.split(key)
        nxt = int(jax.random.categorical(sub, last / temperature))
      else:
        nxt = int(jnp.argmax(last))
      yield nxt
      if nxt in stop_ids or i == max_new_tokens - 1:
        return
      logits, cache = self._run(jnp.asarray([[nxt]], jnp.int32), cache, t + i)
      last = logits[0, -1]

  def generate(
    self,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
  ) -> list[int]:
    """The new token ids (up to max_new_tokens) after prompt_ids; greedy by default (KV cache)."""
    return list(
      self.stream(prompt_ids, max_new_tokens, temperature=temperature, seed=seed, stop_ids=stop_ids)
    )


def _q8_rule(paths: list[tuple[str, ...]]) -> Q8Rule:
  """One rule matching exactly the Dense modules at `paths` (module path = param path minus leaf)."""
  alternatives = "|".join(re.escape("/".join(p[:-1])) for p in sorted(paths))
  return Q8Rule(module_path=f"(?:{alternatives})", scale_dtype=jnp.float16)


def _traced_params(config: TransformerConfig, q8_dense: list[tuple[str, ...]]) -> dict[str, Any]:
  """The quantized model's param shapes (`jax.eval_shape` of init: nothing allocated).

  Tracing init of a many-layer model through qwix takes seconds, so it is traced on
  one-layer models, once per distinct set of Q8_0 Dense kernels in a layer, and each
  layer takes the subtree of its kind (the same structure a full trace gives).
  """
  q8 = set(q8_dense)
  top = [p for p in q8 if not p[0].startswith("layers_")]

  def kind(i: int) -> frozenset[tuple[str, ...]]:
    return frozenset(p[1:] for p in q8 if p[0] == f"layers_{i}")

  one = dataclasses.replace(config, layers=1)
  traced: dict[frozenset[tuple[str, ...]], Any] = {}
  for i in range(config.layers):
    k = kind(i)
    if k in traced:
      continue
    paths = [("layers_0", *p) for p in k] + top
    model: nn.Module = Transformer(one)
    if paths:
      model = qwix.quantize_model(model, Q8Provider([_q8_rule(paths)]))
    ids = jnp.zeros((1, 1), jnp.int32)
    traced[k] = jax.eval_shape(model.init, jax.random.key(0), ids, init_cache(one, 1), 0)["params"]
  first = traced[kind(0)]
  params = {name: sub for name, sub in first.items() if name != "layers_0"}
  for i in range(config.layers):
    params[f"layers_{i}"] = traced[kind(i)]["layers_0"]
  return params


def _abstract_params(
  config: TransformerConfig, q8_dense: list[tuple[str, ...]], ckpt: Any, slots: dict[str, Any]
) -> Any:
  """The param tree's shapes, with each float leaf in its file dtype and the embedding
  table as the file's tensor spec (Q8Array or array)."""
  params = _traced_params(config, q8_dense)
  by_path = {slot.path: name for name, slot in slots.items()}

  def fix(path: tuple[Any, ...], leaf: Any) -> Any:
    keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    name = by_path.get(keys)
    if name is None or isinstance(leaf, Q8Array) or not isinstance(leaf, jax.ShapeDtypeStruct):
      return leaf
    spec = ckpt.spec(name)
    if keys == ("embed", "table"):
      return spec
    dtype = spec.dtype if not isinstance(spec, Q8Array) else leaf.dtype
    return jax.ShapeDtypeStruct(leaf.shape, dtype)

  return jax.tree_util.tree_map_with_path(fix, params, is_leaf=lambda x: isinstance(x, Q8Array))


class _Releasing(Mapping[str, Any]):
  """A checkpoint whose tensors' file pages are dropped from memory once read (`release`),
  so that loading holds the loaded params, not the params and the mapped file."""

  def __init__(self, ckpt: Any):
    self._ckpt = ckpt
    self.path = ckpt.path

  def spec(self, name: str) -> Any:
    return self._ckpt.spec(name)

  def __getitem__(self, name: str) -> Any:
    value = self._ckpt[name]
    self._ckpt.release(name)
    return value

  def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
    return name in self._ckpt

  def __iter__(self) -> Iterator[str]:
    return iter(self._ckpt)

  def __len__(self) -> int:
    return len(self._ckpt)


def _place_on_mesh(abstract: Any, mesh: Any) -> Any:
  """The abstract tree with each leaf carrying its NamedSharding under TP_SPECS."""
  shardings = param_shardings(abstract, mesh, TP_SPECS, strict=False)

  def with_sharding(leaf: Any, s: Any) -> Any:
    if isinstance(leaf, Q8Array):
      return dataclasses.replace(
        leaf,
        q=jax.ShapeDtypeStruct(leaf.q.shape, leaf.q.dtype, sharding=s.q),
        scale=jax.ShapeDtypeStruct(leaf.scale.shape, leaf.scale.dtype, sharding=s.scale),
      )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)

  is_q8 = lambda x: isinstance(x, Q8Array)  # noqa: E731
  return jax.tree_util.tree_map(with_sharding, abstract, shardings, is_leaf=is_q8)


def load_gguf(
  path: Any,
  *,
  dtype: Any = jnp.bfloat16,
  mesh: Any = None,
  dequantize_other: bool = False,
  progress: bool | None = None,
) -> GGUFModel:
  """Load a llama.cpp GGUF model (arch `llama` or `qwen2`) to run in JAX.

  Args:
    path: the .gguf file, or the first part of a split set
      (`name-00001-of-0000N.gguf`: all parts are opened).
    dtype: activation dtype (bfloat16 or float32). Weights keep the file's
      types: Q8_0 as Q8Arrays, F32 / F16 / BF16 as they are.
    mesh: a `jax.sharding.Mesh` with an axis 'tp': each tensor goes from the
      file straight to its shards (`TP_SPECS`: column-parallel q, k, v, gate,
      up; row-parallel o, down; the rest replicated).
    dequantize_other: load tensors of other quantized types (Q4_0, Q4_K, ...)
      as float32, with a warning; by default they are refused.
    progress: a tqdm bar over tensors (None: when stderr is a terminal).

  Returns:
    A `GGUFModel`.

  Raises:
    CheckpointError (naming the file and tensor; nothing is returned
      half-loaded): unsupported arch or tensor type, a missing or unexpected
      tensor, a shape that disagrees with the metadata, a truncated file, a
      split set with a part missing.
  """
  ckpt = open_gguf(
    path, scale_dtype=np.float16, dequantize_other=dequantize_other, progress=progress
  )
  try:
    return _load(ckpt, dtype=dtype, mesh=mesh, progress=progress)
  finally:
    ckpt.close()


def _load(ckpt: Any, *, dtype: Any, mesh: Any, progress: bool | None) -> GGUFModel:
  meta = ckpt.metadata
  shapes = {name: ckpt.gguf_shape(name) for name in ckpt}
  embd = shapes.get("token_embd.weight")
  if embd is None or len(embd) != 2:
    raise CheckpointError(f"{ckpt.path}: tensor 'token_embd.weight' missing or not a matrix")
  config = config_from_metadata(
    meta,
    path=str(ckpt.path),
    vocab=embd[0],
    tied_embeddings="output.weight" not in shapes,
    rope_freq_factors="rope_freqs.weight" in shapes,
    dtype=dtype,
  )
  check_tensors(ckpt.path, shapes, config)
  slots = tensor_slots(config)
  other = [
    f"{n!r}: {ckpt.tensor_type(n).name}"
    for n in slots
    if ckpt.tensor_type(n) != Q8_0 and ckpt.tensor_type(n) not in PLAIN_TYPES
  ]
  if other:
    warnings.warn(
      f"{ckpt.path}: {len(other)} tensor(s) of other quantized types are loaded as float32"
      f" (dequantize_other=True): {', '.join(other[:8])}{' ...' if len(other) > 8 else ''}",
      stacklevel=3,
    )
  q8_dense = [s.path for n, s in slots.items() if s.dense and ckpt.tensor_type(n) == Q8_0]
  model: nn.Module = Transformer(config)
  if q8_dense:
    model = qwix.quantize_model(model, Q8Provider([_q8_rule(q8_dense)]))
  abstract = _abstract_params(config, q8_dense, ckpt, slots)
  if mesh is not None:
    abstract = _place_on_mesh(abstract, mesh)
  name_map = {name: slot.path for name, slot in slots.items()}
  params = ckpt_assign.assign(abstract, _Releasing(ckpt), name_map, progress=progress)
  tokenizer = None
  if "tokenizer.ggml.model" in meta:
    from q8rules.llm.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.from_metadata(meta, path=str(ckpt.path))
  return GGUFModel(ckpt.path, config, model, params, meta, tokenizer, mesh)


__all__ = ["GGUFModel", "load_gguf"]
