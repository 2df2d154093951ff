"""`merge_lora`: LoRA adapters folded into their Q8_0 params, for a plain `Q8Provider` model.

Each adapted param's (K, N) matrix becomes

    W' = Q8_0( float32( float64(q * d) + float64(alpha / rank) * (float64(A) @ float64(B)) ) )

computed on the host: the dequantised weight is exact in float64 (an int8 times a float32 or
float16 scale), the delta is summed in float64, the sum is rounded once to float32 (round to
nearest even) and requantized by `q8rules.quantize` (llama.cpp's quantizer, bit for bit) with the
param's scale dtype. Padded rows (K to a multiple of 32) stay zero. The result is what
`q8rules.quantize_params` makes of that float32 merged weight, bit for bit.

The merged model is not the adapted one: its weight is requantized (an error of about one
Q8_0 step, 1/254 of a block's largest magnitude), and a table that a lookup also reads (a tied
head's embedding) carries the delta into the lookup too, where the adapted model applied it to
the head's product only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from q8rules._qwix import QuantizationProvider, unbox
from q8rules.lora.params import (
  Adapters,
  LoraAdapter,
  Tree,
  checked_site,
  path_name,
  placed_like,
  reboxed,
  split_lora,
)
from q8rules.q8_0 import BLOCK, Q8Array, quantize
from q8rules.rules import Q8Rule


def merged_weight(q8: Q8Array, adapter: LoraAdapter) -> np.ndarray:
  """The float32 (K_padded, N) matrix `q * d + A @ B * alpha / rank`, summed in float64; for a
  stack of experts (*E, K_padded, N), each expert's matrix with its own adapter.

  Args:
    q8: the param's Q8_0 values, q int8 (*E, K_padded, N) and scales (*E, K_padded/32, N).
    adapter: A float32 (*E, K, rank), B float32 (*E, rank, N), K <= K_padded.
  """
  q = np.asarray(q8.q).astype(np.float64)
  d = np.repeat(np.asarray(q8.scale).astype(np.float64), BLOCK, axis=-2)
  w = q * d
  k = adapter.a.shape[-2]
  a64, b64 = np.asarray(adapter.a, np.float64), np.asarray(adapter.b, np.float64)
  with np.errstate(over="ignore", invalid="ignore"):  # non-finite: `quantize` names the param
    w[..., :k, :] += adapter.scale * (a64 @ b64)
    return w.astype(np.float32)


def merged_q8(q8: Q8Array, adapter: LoraAdapter, name: str) -> Q8Array:
  """`merged_weight` requantized to Q8_0 as the param was (its scale dtype and float dtype),
  placed where its values were (device and sharding).

  Raises:
    ValueError naming `name`: the merged weight holds non-finite values.
  """
  merged = quantize(
    merged_weight(q8, adapter), axis=q8.axis, scale_dtype=np.dtype(q8.scale.dtype), name=name
  )
  return dataclasses.replace(
    merged,
    q=placed_like(merged.q, q8.q),
    scale=placed_like(merged.scale, q8.scale),
    dtype=q8.dtype,
  )


def merge_lora(
  params: Any,
  lora: QuantizationProvider | Sequence[Q8Rule] | Mapping[str, LoraAdapter],
) -> Any:
  """Fold LoRA adapters into their Q8_0 params (see the module for the numbers).

  Args:
    params: linen: a params dict; nnx: the model. Either the adapted one (its adapters are
      merged) or a plain one (the adapters come as `lora`).
    lora: where the adapters and their alpha come from. A `Q8LoraProvider` or its rules: the
      adapters in `params`, each scaled by the alpha of the rule that matches its module
      (`q8rules.lora.params.rule_alpha`). A dict of `LoraAdapter`s (`split_lora`,
      `load_lora`): those, each with its own alpha; `params` must then hold none.

  Returns:
    The params of a plain `Q8Provider` model with the same rules: linen, a params dict without
    adapter leaves; nnx, a pure dict of state without `nnx.LoRAParam`s, for
    `nnx.update(q8_model, ...)` on the model `qwix.quantize_model(float_model, Q8Provider(rules),
    ...)` makes.

  Raises:
    ValueError naming the param: no adapter to merge; adapters in `params` and given as well;
    no Q8 param at an adapter's path; shapes that do not fit it; no rule, or rules that disagree,
    for its module; a merged weight that is not finite.
    TypeError: params or lora of another kind.
  """
  tree = Tree.of(params, "merge_lora")
  sites = tree.adapter_sites()
  if isinstance(lora, Mapping):
    if sites:
      raise ValueError(
        "merge_lora: ambiguous: adapters were given and the params hold adapters of their own"
        f" ({', '.join(path_name(p) for p in sites)}); merge the params' with their rules, or"
        " split them off first"
      )
    adapters: Adapters = dict(lora)
  elif not sites:
    raise ValueError(
      "merge_lora: the params hold no LoRA adapter to merge (no '<name>_lora_a' /"
      " '<name>_lora_b' beside a Q8 param)"
    )
  else:
    adapters = split_lora(params, lora)[1]
  if not adapters:
    raise ValueError("merge_lora: no LoRA adapter given to merge")
  by_name = tree.q8_paths()
  flat = tree.base_flat()
  for name, adapter in adapters.items():
    base = by_name.get(name)
    if base is None:
      raise ValueError(f"LoRA adapter of {name}: the params hold no Q8 param {name} to merge into")
    q8, _ = checked_site(tree, base, adapter)
    merged = merged_q8(q8, adapter, name)
    if tree.model is None:
      old = flat[base]
      flat[base] = reboxed(old, unbox(old).replace(array=merged))
    else:
      flat[base + ("array", "q")] = merged.q
      flat[base + ("array", "scale")] = merged.scale
  return tree.unflatten(flat)


__all__ = ["merge_lora", "merged_q8", "merged_weight"]
