"""`load_gguf`: a llama.cpp GGUF file as the one `Transformer`, with its Q8_0 tensors as stored.

Every Q8_0 tensor stays a `Q8Array` (int8 values, the file's float16 scales). The
model is `q8rules.models.Transformer` quantized by one `q8rules.Q8Rule` that matches
exactly the modules whose weight is Q8_0 in the file (the embedding table included:
its lookup reads the looked-up columns' Q8_0 values and, with tied embeddings, the
output projection reads the same values). F32 / F16 / BF16 tensors keep their dtype.

Blocks run under `nn.scan` when each block tensor has one type across the layers
(as llama.cpp's converter writes them): the per-layer tensors are stacked at load and
one layer is traced. A file that mixes types across layers runs unrolled.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import assign as ckpt_assign
from q8rules.checkpoint.gguf import PLAIN_TYPES, Q8_0, open_gguf
from q8rules.llm import param_specs
from q8rules.llm.config import config_from_metadata
from q8rules.llm.distributed import check_mesh
from q8rules.llm.fuse import Fusion, fused_paths
from q8rules.llm.fuse import plan as fuse_plan
from q8rules.llm.model import GGUFModel, tp_specs
from q8rules.llm.qat import TRAINABLE, qat_params
from q8rules.llm.sources import GGUFSource, source_of
from q8rules.llm.stacked import StackedTensors
from q8rules.llm.tensors import TensorSlot, check_tensors, tensor_slots
from q8rules.lora.convert import attach_lora_files
from q8rules.lora.gguf_file import read_lora_gguf
from q8rules.models.transformer import Transformer, TransformerConfig
from q8rules.providers import Q8Provider, Q8QatProvider
from q8rules.q8_0 import Q8Array
from q8rules.rules import q8_rule
from q8rules.sharding import param_shardings


def uniform_across_layers(ckpt: Any, slots: Mapping[str, TensorSlot]) -> bool:
  """Whether every block tensor is served as one type in all layers (so the blocks can be
  stacked): a file that mixes quantized types across layers, requantized, stacks."""
  types: dict[tuple[str, ...], set[Any]] = {}
  for name, slot in slots.items():
    if slot.layer is not None:
      types.setdefault(slot.path[1:], set()).add(ckpt.served_type(name))
  return all(len(t) == 1 for t in types.values())


def _place_on_mesh(abstract: Any, mesh: Any, config: TransformerConfig) -> Any:
  """The abstract tree with each leaf carrying its NamedSharding under `tp_specs(config)`."""
  shardings = param_shardings(abstract, mesh, tp_specs(config), strict=False)

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


def _tokenizer(meta: Mapping[str, Any], path: str) -> Any:
  """The file's tokenizer, or None with one warning saying why (the weights load either way)."""
  if "tokenizer.ggml.model" not in meta:
    warnings.warn(f"{path}: no tokenizer in the file; the model runs from token ids", stacklevel=3)
    return None
  from q8rules.llm.tokenizer import GGUFTokenizer

  try:
    return GGUFTokenizer.from_metadata(meta, path=path)
  except (CheckpointError, ValueError, KeyError, TypeError) as e:
    warnings.warn(
      f"{path}: the tokenizer could not be built, so the model runs from token ids"
      f" (.tokenizer is None): {e}",
      stacklevel=3,
    )
    return None


def load_gguf(
  path: Any,
  *,
  dtype: Any = jnp.bfloat16,
  mesh: Any = None,
  dequantize_other: bool = False,
  quantize: str | None = None,
  progress: bool | None = None,
  fuse: bool = True,
  act_qtype: str | None = None,
  lora: Any = None,
  lora_scale: float | Sequence[float] = 1.0,
  trainable: str | None = None,
) -> GGUFModel:
  """Load a llama.cpp GGUF model (an arch of `q8rules.llm.SUPPORTED_ARCHS`) to run in JAX.

  Args:
    path: the .gguf file, or the first part of a split set
      (`name-00001-of-0000N.gguf`: all parts are opened).
    dtype: activation dtype (bfloat16 or float32). Weights: Q8_0 as Q8Arrays (the file's
      blocks as they are); every other quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
      IQ*, ...) requantized to Q8_0 at load, tensor by tensor, a few rows float at a time
      (`q8rules.checkpoint.gguf.requant`; `GGUFModel.requantized` counts them); F32 / F16 /
      BF16 as they are (see `quantize`).
    mesh: a `jax.sharding.Mesh` with an axis 'tp' (Auto or Explicit axes; other
      axes replicate the params): each tensor goes from the file straight to its
      shards (`TP_SPECS`: column-parallel q, k, v, gate, up; row-parallel o,
      down; the rest replicated). On a mesh over several processes (after
      `jax.distributed.initialize`; every process makes the same call) each
      process reads only the byte ranges of its own devices' shards
      (`GGUFModel.bytes_read` says how many).
    dequantize_other: load tensors of other quantized types (Q4_0, Q4_K, ...) as float32,
      with a warning, instead of requantizing them to Q8_0.
    quantize: None, or 'q8_0': the float weight matrices (F32 / F16 / BF16, as
      `llama-quantize` picks them: not the norms) are quantized to Q8_0 at load, the blocks
      bit-equal to `llama-quantize`'s Q8_0 output of the file.
    progress: a tqdm bar over tensors (None: when stderr is a terminal).
    fuse: each layer's q | k | v and gate | up matrices concatenated along their output
      axis at load, one product each (`q8rules.llm.fuse`: the file's Q8_0 values and
      scales as they are, the same output columns; `config.fused_qkv` / `fused_gate_up`
      say what was fused). Not on a mesh, nor for blocks that run unrolled.
    act_qtype: None (weight-only: float32-accurate products, the default), or 'q8_0': the
      activations of every Q8_0 product quantized to Q8_0 as llama.cpp does, products on
      int8 block dots (`q8rules.kernels.matmul_act_q8`; AVX-512 VNNI on the CPU).
    lora: a llama.cpp LoRA adapter file (ours, `GGUFModel.save_lora_gguf`, or one
      `convert_lora_to_gguf.py` wrote), or a list of them: applied unmerged, as llama.cpp's
      `--lora` applies them (`q8rules.lora.convert.attach_lora_files`); `GGUFModel.lora` says so.
    lora_scale: each file's `lora_scale` (one for all, or one per file): its delta is scaled
      by lora_scale * alpha / rank, as llama.cpp's `--lora-scaled`.
    trainable: None (served: Q8_0 params), or 'qat': for full fine-tuning with fake quant
      (`q8rules.llm.qat`): each matrix served as Q8_0 is a float32 param equal to its Q8_0
      values exactly (q * d), and the model runs under `Q8QatProvider` with the same rule, so
      its outputs are the served model's and `jax.grad` of them is the straight-through one.
      `GGUFModel.save_gguf` writes the matrices back as Q8_0.

  Returns:
    A `GGUFModel`. Its `tokenizer` is None, with a warning saying why, when the
    file's tokenizer cannot be built: the weights never wait on the tokenizer.

  Raises:
    CheckpointError (naming the file and tensor; nothing is returned
      half-loaded): unsupported arch or tensor type (one `gguf.quants` cannot
      dequantize), a corrupt block (one that decodes to inf or NaN), a missing or unexpected
      tensor, a shape that disagrees with the metadata, a truncated file, a
      split set with a part missing.
  """
  if trainable not in TRAINABLE:
    raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
  files, scales = _lora_files(lora, lora_scale)
  ckpt = open_gguf(
    path,
    scale_dtype=np.float16,
    dequantize_other=dequantize_other,
    quantize=quantize,
    progress=progress,
  )
  try:
    plan = plan_load(
      ckpt, dtype=dtype, mesh=mesh, fuse=fuse, act_qtype=act_qtype, trainable=trainable
    )
    m = _assemble(ckpt, plan, mesh=mesh, progress=progress, trainable=trainable)
  finally:
    ckpt.close()
  if files:
    m = attach_lora_files(m, files, scales)
  return m


def _lora_files(lora: Any, lora_scale: Any) -> tuple[list[Any], list[float]]:
  """The adapter files of `load_gguf(lora=, lora_scale=)`, read and checked before the model
  loads, and one finite scale per file.

  Raises:
    ValueError: a scale that is not a finite number, or scales that do not match the files.
    CheckpointError naming the adapter file: see `read_lora_gguf`.
  """
  if lora is None:
    return [], []
  paths = [lora] if isinstance(lora, str | bytes) or hasattr(lora, "__fspath__") else list(lora)
  scales = [lora_scale] * len(paths) if isinstance(lora_scale, int | float) else list(lora_scale)
  if len(scales) != len(paths):
    raise ValueError(f"{len(scales)} lora_scale value(s) for {len(paths)} adapter file(s)")
  for s in scales:
    if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
      raise ValueError(f"lora_scale must be a finite number, got {s!r}")
  return [read_lora_gguf(p) for p in paths], [float(s) for s in scales]


@dataclasses.dataclass(frozen=True)
class LoadPlan:
  """What `load_gguf` builds before it reads a tensor.

  Attributes:
    config: the model's config (fusion applied; `scan_layers` False for a file whose block
      tensors change type across layers).
    model: the `Transformer`, quantized by `provider` when a tensor is Q8_0.
    provider: the `Q8Provider` of `rule` (`Q8QatProvider` for trainable='qat'), or None (no
      Q8_0 matrix in the file).
    rule: the one Q8 rule, matching exactly the modules of `q8_paths` (float16 scales).
    q8_paths: the param paths served as Q8_0 (the fused ones in place of their members).
    tensors: the file's tensors as the model reads them (stacked, fused).
    names: tensor name (as `tensors` names it) -> param path.
    shapes: every tensor of the file, GGUF name -> shape in numpy order.
    source: the file(s) and where each of their tensors goes in the params (for `save_gguf`).
  """

  config: TransformerConfig
  model: nn.Module
  provider: Q8Provider | None
  rule: Any
  q8_paths: list[tuple[str, ...]]
  tensors: StackedTensors
  names: dict[str, tuple[str, ...]]
  shapes: dict[str, tuple[int, ...]]
  source: GGUFSource | None = None


def plan_load(
  ckpt: Any,
  *,
  dtype: Any,
  mesh: Any,
  fuse: bool,
  act_qtype: str | None = None,
  trainable: str | None = None,
) -> LoadPlan:
  """The config, model and tensor map of `ckpt` (`load_gguf`'s arguments; nothing read but
  the header). Raises CheckpointError as `load_gguf` does."""
  meta = ckpt.metadata
  shapes = {name: ckpt.gguf_shape(name) for name in ckpt}
  embd = shapes.get("token_embd.weight")
  if embd is None or len(embd) != 2:
    raise CheckpointError(f"{ckpt.path}: tensor 'token_embd.weight' missing or not a matrix")
  config = config_from_metadata(
    meta,
    path=str(ckpt.path),
    vocab=embd[0],
    tensors=shapes,
    dtype=dtype,
  )
  check_tensors(ckpt.path, shapes, config)
  if not uniform_across_layers(ckpt, tensor_slots(config)):
    config = dataclasses.replace(config, scan_layers=False)
  slots = tensor_slots(config)
  other = [
    f"{n!r}: {ckpt.tensor_type(n).name}"
    for n in slots
    if ckpt.tensor_type(n) not in PLAIN_TYPES and ckpt.served_type(n) != Q8_0
  ]
  if other:
    warnings.warn(
      f"{ckpt.path}: {len(other)} tensor(s) of other quantized types are loaded as float32"
      f" (dequantize_other=True): {', '.join(other[:8])}{' ...' if len(other) > 8 else ''}",
      stacklevel=4,
    )
  fusion = fuse_plan(ckpt, config, slots) if fuse and mesh is None else Fusion(config, {})
  q8_paths = [s.path for n, s in slots.items() if s.dense and ckpt.served_type(n) == Q8_0]
  q8_paths = fused_paths(q8_paths, fusion)
  config = fusion.config  # the model's (the file's slots stay `slots`)
  model: nn.Module = Transformer(config)
  rule = q8_rule(q8_paths, act_qtype)
  provider_type = Q8QatProvider if trainable == "qat" else Q8Provider
  provider = provider_type([rule]) if q8_paths else None
  if provider is not None:
    model = qwix.quantize_model(model, provider)
  tensors = StackedTensors(ckpt, slots, fusion.slots)
  names = tensors.name_map(slots)
  source = source_of(ckpt, slots, fusion.slots)
  return LoadPlan(config, model, provider, rule, q8_paths, tensors, names, shapes, source)


def _assemble(
  ckpt: Any, plan: LoadPlan, *, mesh: Any, progress: bool | None, trainable: str | None
) -> GGUFModel:
  """The `GGUFModel` of `plan`: its parameters read from `ckpt` (placed on `mesh`), its
  tokenizer built from the metadata."""
  config, tensors, names = plan.config, plan.tensors, plan.names
  # the tree jax.eval_shape of the model's init gives (param_specs.traced_params), untraced
  abstract = param_specs.file_params(tensors, names, plan.q8_paths, plan.rule.scale_dtype)
  if mesh is not None:
    check_mesh(mesh, config, ckpt.path, plan.shapes)  # llm/distributed.py: names the tensor
    abstract = _place_on_mesh(abstract, mesh, config)
  params = ckpt_assign.assign(abstract, tensors, names, progress=progress)  # shard by shard
  if trainable == "qat":
    params = qat_params(params)
  tokenizer = _tokenizer(ckpt.metadata, str(ckpt.path))
  out = GGUFModel(ckpt.path, config, plan.model, params, ckpt.metadata, tokenizer, mesh)
  out.source = plan.source
  if plan.provider is not None:
    out.rule, out.provider_type = plan.rule, type(plan.provider)
  out.bytes_read = tensors.bytes_read
  out.requantized = ckpt.requantized
  return out


__all__ = ["LoadPlan", "load_gguf", "plan_load", "uniform_across_layers"]
