"""A GGUF model's adapters in from llama.cpp's LoRA files (`load_gguf(lora=...)`) and out into
its weights (`GGUFModel.merged`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.checkpoint import CheckpointError
from q8rules.lora.fuse import refuse, unfuse
from q8rules.lora.gguf_model import (
  KINDS,
  LoraSpec,
  adapter_sites,
  check_expert_targets,
  file_kinds,
  lora_model,
  placed_like_base,
  tensor_name,
  with_adapters,
)
from q8rules.lora.loaded import LoadedModel
from q8rules.lora.merge import merged_q8
from q8rules.lora.params import LoraAdapter, placed_like
from q8rules.lora.tree import get_in, set_in
from q8rules.providers.q8_weight import Q8Weight
from q8rules.q8_0 import Q8Array
from q8rules.sharding.adapters import LORA_A, LORA_B


def _site(name: str, config: Any, present: set[str], where: str) -> tuple[str, int]:
  """(kind, layer) of the base tensor `name` ('blk.3.attn_q.weight') an adapter file names.

  Raises:
    CheckpointError naming the file and tensor: not a block matrix q8rules adapts, or a tensor
    the base model does not have.
  """
  parts = name.split(".")
  if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
    raise CheckpointError(
      f"{where}: LoRA tensor {name!r}: q8rules adapts the block matrices"
      f" (blk.N.<kind>.weight, kind one of {list(KINDS)}), not this one"
    )
  kind, layer = parts[2], int(parts[1])
  if kind not in KINDS:
    raise CheckpointError(
      f"{where}: LoRA tensor {name!r}: kind {kind!r} is not one q8rules adapts ({list(KINDS)})"
    )
  if kind not in present or layer >= config.layers:
    raise CheckpointError(
      f"{where}: LoRA tensor {name!r} does not exist in the base model (wrong base model?)"
    )
  return kind, layer


def attach_lora_files(m: LoadedModel, files: Sequence[Any], scales: Sequence[float]) -> Any:
  """`m` with the adapters of llama.cpp LoRA files (`q8rules.lora.gguf_file.LoraFile`)
  applied unmerged, each delta scaled as llama.cpp scales it (`LoraFile.scale`).

  One file (with a scale > 0) keeps its A and B as they are (the rule's alpha = lora_scale *
  alpha). Several are summed as llama.cpp sums them: their A's concatenated along the rank,
  their B's too, each B times its file's scale (rounded to float32), under a rule of scale 1; a
  tensor a file does not adapt gets zeros in that file's part (an exact zero delta). Each file
  has one rank; a tensor or layer no file adapts gets zero adapters.

  Raises:
    CheckpointError naming the adapter file and tensor: another arch, a tensor the base lacks
    or one q8rules does not adapt, shapes that do not fit the base, ranks that differ in a file.
  """
  arch = m.metadata.get("general.architecture")
  present = file_kinds(m.path)
  ranks = []
  for f in files:
    if f.arch != arch:
      raise CheckpointError(
        f"{f.path}: the adapter is for arch {f.arch!r}, the base model {m.path} is {arch!r}"
      )
    for name in f.adapters:
      _site(name, m.config, present, f.path)
    file_ranks = {a.shape[-1] for a, _ in f.adapters.values()}
    if len(file_ranks) != 1:
      raise CheckpointError(
        f"{f.path}: adapters of different ranks {sorted(file_ranks)}; q8rules serves one rank"
        " per adapter file"
      )
    ranks.append(file_ranks.pop())
  rank = sum(ranks)
  names = {n for f in files for n in f.adapters}
  if len(files) == 1 and scales[0] > 0:  # A and B as the file has them
    alpha = float(files[0].alpha * scales[0]) if files[0].alpha else float(scales[0] * rank)
    combined = dict(files[0].adapters)
  else:  # several files, or a scale <= 0: each B times its scale, under a rule of scale 1
    alpha = float(rank)
    combined = {}
    for n in sorted(names):
      a_parts, b_parts = [], []
      for f, lora_scale in zip(files, scales, strict=True):
        a, b = f.adapters.get(n, (None, None))
        if a is None:  # this file does not adapt the tensor: a zero delta of its rank
          a_parts.append(None)
          b_parts.append(None)
          continue
        a_parts.append(a)
        b_parts.append((b * np.float32(f.scale(n, lora_scale))).astype(np.float32))
      a0 = next(a for a in a_parts if a is not None)  # (*E, K, r)
      n_out = next(b.shape[-1] for b in b_parts if b is not None)
      a_parts = [
        a if a is not None else np.zeros((*a0.shape[:-1], r), np.float32)
        for a, r in zip(a_parts, ranks, strict=True)
      ]
      b_parts = [
        b if b is not None else np.zeros((*a0.shape[:-2], r, n_out), np.float32)
        for b, r in zip(b_parts, ranks, strict=True)
      ]
      combined[n] = (np.concatenate(a_parts, axis=-1), np.concatenate(b_parts, axis=-2))
  kinds = {_site(n, m.config, present, "")[0] for n in combined}
  spec = LoraSpec(rank, alpha, tuple(k for k in KINDS if k in kinds))
  try:
    check_expert_targets(m.config, spec.targets, [f.path for f in files])
  except ValueError as e:
    raise CheckpointError(str(e)) from None
  config, params, split = unfuse(m.config, m.params, spec.targets, present)
  spec = dataclasses.replace(spec, unfused=split)
  stacked = {}
  for kind, path in adapter_sites(config, params, spec.targets):
    base = get_in(params, path)
    if not isinstance(base, Q8Weight):
      raise CheckpointError(
        f"{m.path}: LoRA target {kind} ({'/'.join(path)}) is not a Q8_0 weight; load the base"
        " with quantize='q8_0'"
      )
    *experts, k, n = base.how.layout.shape  # experts: (E,) for a stack
    layers = range(config.layers) if config.scan_layers else [int(path[0].split("_")[1])]
    a_all = np.zeros((len(layers), *experts, k, rank), np.float32)
    b_all = np.zeros((len(layers), *experts, rank, n), np.float32)
    for j, layer in enumerate(layers):
      name = tensor_name(kind, layer)
      if name not in combined:
        continue
      a, b = combined[name]
      if a.shape != (*experts, k, rank) or b.shape != (*experts, rank, n):
        stack = f"{experts[0]} experts, " if experts else ""
        raise CheckpointError(
          f"{[f.path for f in files]}: LoRA tensor {name!r}: A {a.shape} and B {b.shape} do not"
          f" fit the base's ({stack}K={k}, N={n}) at rank {rank} (wrong base model?)"
        )
      a_all[j], b_all[j] = a, b
    if not config.scan_layers:
      a_all, b_all = a_all[0], b_all[0]
    a_dev = placed_like_base(jnp.asarray(a_all), base, "a")
    stacked[path] = (a_dev, placed_like_base(jnp.asarray(b_all), base, "b"))
  params = with_adapters(params, stacked)
  model = lora_model(config, params, spec)
  return dataclasses.replace(m, config=config, model=model, params=params, lora=spec)


def merged_params(m: LoadedModel) -> tuple[Any, Any]:
  """The (config, params) of `GGUFModel.merged`: each adapter folded into its Q8_0 base, layer
  by layer, as `q8rules.merge_lora` folds one (`W + alpha / rank * A @ B` summed in float64,
  rounded once to float32, requantized to Q8_0 with float16 scales), the load-fused groups
  fused again (`GGUFModel.merged` serves them by a plain `Q8Provider`).

  Raises:
    ValueError naming the file: the model has no adapters; naming the tensor: a merged weight
    that is not finite.
  """
  if m.lora is None:
    raise ValueError(f"{m.path}: the model has no LoRA adapters to merge (use with_lora first)")
  params = m.params
  for kind, path in adapter_sites(m.config, params, m.lora.targets):
    node = dict(get_in(params, path[:-1]))
    base = node[path[-1]]
    a_all = np.asarray(jax.device_get(node.pop(path[-1] + LORA_A)), np.float32)
    b_all = np.asarray(jax.device_get(node.pop(path[-1] + LORA_B)), np.float32)
    q_all = np.asarray(jax.device_get(base.array.q))
    s_all = np.asarray(jax.device_get(base.array.scale))
    if not m.config.scan_layers:
      q_all, s_all, a_all, b_all = q_all[None], s_all[None], a_all[None], b_all[None]
    layers = range(m.config.layers) if m.config.scan_layers else [int(path[0].split("_")[1])]
    q_out, s_out = np.empty_like(q_all), np.empty_like(s_all)
    for j, layer in enumerate(layers):
      axis = q_all.ndim - 3  # K: 0 for a matrix, 1 for a stack of experts (E, K, N)
      one = Q8Array(q=q_all[j], scale=s_all[j], axis=axis, dtype=base.array.dtype)
      adapter = LoraAdapter(a_all[j], b_all[j], m.lora.alpha)
      out = merged_q8(one, adapter, tensor_name(kind, layer))
      q_out[j], s_out[j] = np.asarray(out.q), np.asarray(out.scale)
    if not m.config.scan_layers:
      q_out, s_out = q_out[0], s_out[0]
    array = dataclasses.replace(
      base.array, q=placed_like(q_out, base.array.q), scale=placed_like(s_out, base.array.scale)
    )
    node[path[-1]] = dataclasses.replace(base, array=array)
    params = set_in(params, path[:-1], node)
  return refuse(m.config, params, m.lora.unfused)


__all__ = ["attach_lora_files", "merged_params"]
