"""`unrolled(m)`: a loaded GGUF model with its layers unrolled (no `nn.scan`).

Under `nn.scan`'s own slicing each decode step slices layer i's weights out of the stacked (L, K, N)
arrays. XLA fuses such a slice into an elementwise consumer, but not into the native Q8
kernel's custom call, so every step first copies every layer's int8 values and scales
(the whole model) and then reads the copy: on the 8-layer dim-2048 file that made decode
2.4x slower (benchmarks/bench_unrolled.py; benchmarks/RESULTS.md, section `unrolled`).
Unrolled, each layer's weights are their own arrays and the kernel reads them in place.

The cost: tracing and compiling the unrolled model takes about L times one layer's time
(the persistent compilation cache, `compile_cache`, keeps the compiled part across
processes, not the tracing), and the weights are split once (one copy, the stacked arrays
are dropped). Logits agree with the scanned model's to float32 rounding (XLA fuses the two
programs differently), not bit for bit. The scanned model now reads its stacked weights in
place too (`TransformerConfig.scan_in_place`, `q8rules.kernels.layer`), and since then
unrolling no longer speeds decode up (0.96x on the 8-layer file; benchmarks/RESULTS.md,
section `unrolled`): this stays for comparison and for programs that need per-layer params.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import qwix

from q8rules._qwix import is_with_aux
from q8rules.lora.loaded import LoadedModel
from q8rules.models.transformer import Transformer
from q8rules.providers import Q8Provider, Q8QatProvider
from q8rules.q8_0 import Q8Array
from q8rules.rules import q8_rule


def _is_q8(x: Any) -> bool:
  return isinstance(x, Q8Array)


def _layer(stacked: Any, i: int) -> Any:
  """Layer i of a stacked param subtree (each Q8Array's q and scale, each float array)."""

  def take(a: Any) -> Any:
    if isinstance(a, Q8Array):
      return dataclasses.replace(a, q=a.q[i], scale=a.scale[i])
    return a[i]

  return jax.tree.map(take, stacked, is_leaf=_is_q8)


def _scanned_module_path(param_path: tuple[str, ...]) -> str:
  """The path, in the scanned model, of the module owning the param at `param_path` (its
  leaf dropped, `layers_i` read as `layers`)."""
  return "/".join(re.sub(r"^layers_\d+$", "layers", k) for k in param_path[:-1])


def rebuilt(m: LoadedModel, config: Any, params: Any = None) -> Any:
  """`m` (a GGUFModel) with `config` and `params` (default: m's), its model quantized again as
  `m`'s was: the same provider type (`m.provider_type`: served Q8_0, or fake quant for a
  `trainable='qat'` model) and rule fields (`m.rule`: scale dtype, `act_qtype`), matching the
  modules whose params are Q8Arrays, or, for a QAT model's float params, the modules `m.rule`
  matched (a layer `layers_i` matching as the scanned `layers`)."""
  params = m.params if params is None else params
  provider_type = m.provider_type or Q8Provider
  qat = provider_type is Q8QatProvider
  paths: list[tuple[str, ...]] = []

  def visit(path: Any, leaf: Any) -> None:  # the param's path (a WithAux's, not its array's)
    keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    if isinstance(leaf, Q8Array) or is_with_aux(leaf):
      paths.append(keys)
    elif (
      qat and m.rule is not None and re.fullmatch(m.rule.module_path, _scanned_module_path(keys))
    ):
      paths.append(keys)

  is_param = lambda x: _is_q8(x) or is_with_aux(x)  # noqa: E731
  jax.tree_util.tree_map_with_path(visit, params, is_leaf=is_param)
  model: Any = Transformer(config)
  rule = None
  if paths:
    rule = q8_rule(paths, m.rule.act_qtype if m.rule is not None else None)
    model = qwix.quantize_model(model, provider_type([rule]))
  return dataclasses.replace(  # a GGUFModel
    m, config=config, model=model, params=params, rule=rule, provider_type=provider_type
  )


def unrolled(m: LoadedModel) -> Any:
  """`m` with `scan_layers=False`: the same weights as per-layer arrays (`layers_0`, ...), the
  model quantized by a rule matching the same modules. `m` itself is returned when its layers
  are not scanned already."""
  if not m.config.scan_layers:
    return m
  config = dataclasses.replace(m.config, scan_layers=False)
  params = dict(m.params)
  stacked = params.pop("layers")
  for i in range(config.layers):
    params[f"layers_{i}"] = _layer(stacked, i)
  return rebuilt(m, config, params)


__all__ = ["rebuilt", "unrolled"]
