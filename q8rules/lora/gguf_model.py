"""LoRA adapters on a loaded GGUF model: `GGUFModel.with_lora`, keyed by the file's own tensors.

    m = q8rules.load_gguf("model.gguf").with_lora(rank=16, alpha=32.0)

gives each targeted weight matrix of every layer (by GGUF tensor kind: `attn_q`, `attn_k`,
`attn_v`, `attn_output`, `ffn_gate`, `ffn_up`, `ffn_down`; `attn_qkv` where the file itself
fuses q | k | v; on request, the expert stacks `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`
(`ffn_gate_up_exps` where the file fuses them), one adapter per expert, A (E, K, rank) and
B (E, rank, N), as llama.cpp's adapter files hold them) a trainable adapter A (K, rank), B
(rank, N) on its frozen Q8_0 base, served by
`q8rules.Q8LoraProvider` (the base through the same kernels, no float copy; the delta
`x @ A @ B * alpha / rank` in float32). With scanned layers the adapters are stacked like their
base: `<param>_lora_a` (L, K, rank) and `<param>_lora_b` (L, rank, N) beside `<param>`
(L, K, N). A is He-uniform (per layer), B zeros: the adapted model starts as the Q8_0 model,
bit for bit.

An adapter belongs to one tensor of the file, as llama.cpp's adapter files key it
(`blk.3.attn_q.weight`). `load_gguf` fuses each layer's q | k | v and gate | up into one product
for decode; a group with an adapted member is split back into its members' products by
columns (the same int8 values and scales: no value changes, no new product numbers), so each
member has its own adapter. A file that stores q | k | v fused (phi3's `attn_qkv`) has its
adapter on that tensor.

On a mesh each adapter follows its base's split (`q8rules.sharding.adapters`): A along K under
a row-parallel base, B along N under a column-parallel one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.sharding import NamedSharding

from q8rules._qwix import unbox
from q8rules.checkpoint.gguf import open_gguf
from q8rules.lora.fuse import unfuse
from q8rules.lora.loaded import LoadedModel
from q8rules.lora.provider import Q8LoraProvider, Q8LoraRule
from q8rules.lora.tree import EXPERT_KINDS, KINDS, get_in, kernel_path, layer_roots, set_in
from q8rules.models.transformer import Transformer
from q8rules.providers.placement import placed_sharding
from q8rules.providers.q8_weight import Q8Weight
from q8rules.q8_0 import Q8Array
from q8rules.rules import q8_rule
from q8rules.sharding.adapters import LORA_A, LORA_B, adapter_spec

DEFAULT_TARGETS = (
  "attn_q",
  "attn_k",
  "attn_v",
  "attn_output",
  "ffn_gate",
  "ffn_up",
  "ffn_down",
)
"""The kinds adapted by default (`attn_qkv` in place of the three where the file fuses them)."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """The adapters of a `GGUFModel` (`GGUFModel.lora`).

  Attributes:
    rank: r of every adapter.
    alpha: the delta's scale is alpha / rank.
    targets: the GGUF tensor kinds adapted, in `KINDS`' order.
    dropout: the dropout rate on x before A in training (`q8rules.lora.trainer`); serving
      runs without it.
    unfused: the config fields ('fused_qkv', 'fused_gate_up') of the load-fused groups split
      into their members for the adapters (`merged` fuses them again).
  """

  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0
  unfused: tuple[str, ...] = ()

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


def file_kinds(path: Any) -> set[str]:
  """The `KINDS` whose tensors the GGUF file at `path` holds (read from its header)."""
  ckpt = open_gguf(path)
  try:
    names = set(ckpt)
  finally:
    ckpt.close()
  return {kind for kind in KINDS if f"blk.0.{kind}.weight" in names}


def resolve_targets(targets: Iterable[str] | None, present: set[str], path: Any) -> tuple[str, ...]:
  """The kinds to adapt, checked: known kinds the file holds (default: `DEFAULT_TARGETS` the file
  holds, `attn_qkv` for a file that fuses q | k | v).

  Raises:
    ValueError naming the file: an unknown kind, or one the file has no tensor of.
  """
  if targets is None:
    wanted = [k for k in (*DEFAULT_TARGETS, "attn_qkv") if k in present]
  else:
    wanted = [targets] if isinstance(targets, str) else list(targets)
    unknown = [k for k in wanted if k not in KINDS]
    if unknown:
      raise ValueError(
        f"{path}: unknown LoRA target(s) {unknown}; targets are GGUF tensor kinds: {list(KINDS)}"
      )
    missing = [k for k in wanted if k not in present]
    if missing:
      raise ValueError(
        f"{path}: no tensor for LoRA target(s) {missing} in the file (blk.0.<kind>.weight);"
        f" it has {sorted(present)}"
      )
  if not wanted:
    raise ValueError(f"{path}: no LoRA target: the file holds none of {list(KINDS)}")
  return tuple(k for k in KINDS if k in wanted)


# ---- the param tree ------------------------------------------------------------------------


def has_adapters(params: Any) -> bool:
  """Whether any leaf of `params` is named as an adapter (`<param>_lora_a` / `_lora_b`)."""
  found = False

  def visit(path: Any, _: Any) -> None:
    nonlocal found
    key = path[-1]
    name = str(getattr(key, "key", getattr(key, "name", key)))
    found = found or name.endswith((LORA_A, LORA_B))

  jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda x: isinstance(x, Q8Weight))
  return found


def placed_like_base(value: jax.Array, base: Any, which: str) -> jax.Array:
  """`value` split as its base's Q8 values are on a mesh (`adapter_spec`), else as it is."""
  sharding = placed_sharding(base.array.q) if isinstance(base, Q8Weight) else None
  if sharding is None:
    return value
  spec = adapter_spec(sharding.spec, which, value.ndim)  # type: ignore[arg-type]
  return jax.device_put(value, NamedSharding(sharding.mesh, spec))


def tensor_name(kind: str, layer: int) -> str:
  """The GGUF name of layer `layer`'s `kind` weight ('blk.3.attn_q.weight')."""
  return f"blk.{layer}.{kind}.weight"


def adapter_sites(config: Any, params: Any, targets: Sequence[str]) -> list[tuple[str, Any]]:
  """(kind, kernel path) of every adapted param, layer roots in order (one per root)."""
  return [(kind, kernel_path(root, kind)) for root in layer_roots(config) for kind in targets]


def initial_adapters(
  config: Any, params: Any, spec: LoraSpec, seed: int, where: Any
) -> dict[tuple[str, ...], tuple[jax.Array, jax.Array]]:
  """Fresh adapters for every site: A He-uniform (`Q8LoraRule`'s default, per layer), B zeros.

  Returns:
    kernel path -> (A (..., K, rank), B (..., rank, N)) float32, stacked like the base.

  Raises:
    ValueError naming the tensor: a base that is not Q8_0, a rank above min(K, N).
  """
  rule = Q8LoraRule(module_path=".*", rank=spec.rank, alpha=spec.alpha)
  key = jax.random.key(seed)
  out = {}
  for i, (kind, path) in enumerate(adapter_sites(config, params, spec.targets)):
    base = get_in(params, path)
    if not isinstance(base, Q8Weight):
      raise ValueError(
        f"{where}: LoRA target {kind} ({'/'.join(path)}) is not a Q8_0 weight"
        f" ({type(unbox(base)).__name__}); load the file with quantize='q8_0' to adapt float"
        " weights"
      )
    k, n = base.how.layout.shape[-2:]
    if spec.rank > min(k, n):
      raise ValueError(
        f"{where}: LoRA rank {spec.rank} exceeds min(K, N) = {min(k, n)} of {kind}"
        f" ({'/'.join(path)}: K={k}, N={n})"
      )
    lead = tuple(base.array.q.shape[:-2])  # (layers,) and (experts,) where stacked
    keys = jax.random.split(jax.random.fold_in(key, i), max(1, math.prod(lead)))

    def one(k_: jax.Array, k=k) -> jax.Array:
      return jnp.asarray(rule.lora_a_initializer(k_, (k, spec.rank), jnp.float32), jnp.float32)

    a = jax.vmap(one)(keys).reshape(*lead, k, spec.rank)
    b = jnp.zeros((*lead, spec.rank, n), jnp.float32)
    out[path] = (placed_like_base(a, base, "a"), placed_like_base(b, base, "b"))
  return out


def with_adapters(params: Any, adapters: Mapping[tuple[str, ...], tuple[Any, Any]]) -> Any:
  """`params` with each (A, B) set beside its kernel path as `kernel_lora_a` / `kernel_lora_b`."""
  for path, (a, b) in adapters.items():
    name = path[-1]
    params = set_in(params, (*path[:-1], name + LORA_A), a)
    params = set_in(params, (*path[:-1], name + LORA_B), b)
  return params


def lora_rule(config: Any, spec: LoraSpec, *, dropout: float = 0.0) -> Q8LoraRule:
  """The `Q8LoraRule` matching exactly the adapted modules (GGUF's float16 scales); with expert
  targets, the Moe module with only the targeted stacks among its params (`Q8LoraRule.params`)."""
  roots = "layers" if config.scan_layers else r"layers_\d+"
  dense = [k for k in spec.targets if k not in EXPERT_KINDS]
  stacks = [KINDS[k][1] for k in spec.targets if k in EXPERT_KINDS]
  modules = {re.escape("/".join(KINDS[k])) for k in dense}
  if stacks:
    modules.add(re.escape(KINDS[EXPERT_KINDS[0]][0]))
  return Q8LoraRule(
    module_path=f"{roots}/(?:{'|'.join(sorted(modules))})",
    rank=spec.rank,
    alpha=spec.alpha,
    dropout=dropout,
    scale_dtype=jnp.float16,
    params=(*(("kernel",) if dense else ()), *stacks) if stacks else (),
  )


def check_expert_targets(config: Any, targets: Iterable[str], where: Any) -> None:
  """Refuse expert-stack targets llama.cpp would apply otherwise than q8rules does.

  Raises:
    ValueError naming the kind: `ffn_down_exps` on a model with a per-expert output scale
      (Gemma 4's `ffn_down_exps.scale`): llama.cpp adds the adapter's delta after that scale
      (`build_lora_mm_id` in src/llama-graph.cpp), q8rules' Moe scales the expert's whole
      output, delta included.
  """
  if "ffn_down_exps" in targets and getattr(config, "expert_down_scale", False):
    raise ValueError(
      f"{where}: LoRA target ffn_down_exps on a model with a per-expert ffn_down_exps.scale:"
      " llama.cpp adds the adapter's delta after that scale, q8rules scales the delta with the"
      " expert's output; adapt ffn_gate_exps / ffn_up_exps / ffn_gate_up_exps instead"
    )


def q8_paths(params: Any) -> list[tuple[str, ...]]:
  """The paths of the Q8 params in `params`."""
  paths: list[tuple[str, ...]] = []

  def visit(path: Any, leaf: Any) -> None:
    if isinstance(leaf, Q8Weight | Q8Array):
      paths.append(tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path))

  is_q8 = lambda x: isinstance(x, Q8Weight | Q8Array)  # noqa: E731
  jax.tree_util.tree_map_with_path(visit, params, is_leaf=is_q8)
  return paths


def lora_model(config: Any, params: Any, spec: LoraSpec, *, dropout: float = 0.0) -> Any:
  """The `Transformer` of `config` under a `Q8LoraProvider`: `spec`'s adapters on the targeted
  products, every other Q8 param served as plain Q8_0."""
  rules = [lora_rule(config, spec, dropout=dropout)]
  plain = q8_paths(params)
  if plain:
    rules.append(q8_rule(plain))
  return qwix.quantize_model(Transformer(config), Q8LoraProvider(rules))


def with_lora(
  m: LoadedModel,
  *,
  rank: int = 16,
  alpha: float = 32.0,
  targets: Iterable[str] | None = None,
  dropout: float = 0.0,
  seed: int = 0,
) -> Any:
  """`GGUFModel.with_lora` (see the module and the method)."""
  if m.lora is not None or has_adapters(m.params):
    raise ValueError(
      f"{m.path}: the model has LoRA adapters already ({m.lora}); merge them (`merged()`) or"
      " start from the loaded model"
    )
  spec = LoraSpec(rank, alpha, (), dropout)
  Q8LoraRule(module_path=".*", rank=rank, alpha=alpha, dropout=dropout)  # checks the numbers
  present = file_kinds(m.path)
  spec = dataclasses.replace(spec, targets=resolve_targets(targets, present, m.path))
  check_expert_targets(m.config, spec.targets, m.path)
  config, params, split = unfuse(m.config, m.params, spec.targets, present)
  spec = dataclasses.replace(spec, unfused=split)
  params = with_adapters(params, initial_adapters(config, params, spec, seed, m.path))
  model = lora_model(config, params, spec)
  return dataclasses.replace(m, config=config, model=model, params=params, lora=spec)


def adapters_of(m: LoadedModel) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """The adapters of `m` per GGUF tensor: 'blk.3.attn_q.weight' -> (A (K, rank), B (rank, N)),
  an expert stack's 'blk.3.ffn_up_exps.weight' -> (A (E, K, rank), B (E, rank, N)), float32
  numpy, one layer each (a stacked adapter split by layer)."""
  if m.lora is None:
    raise ValueError(f"{m.path}: the model has no LoRA adapters (use with_lora first)")
  out = {}
  for kind, path in adapter_sites(m.config, m.params, m.lora.targets):
    node = get_in(m.params, path[:-1])
    a = np.asarray(jax.device_get(node[path[-1] + LORA_A]), np.float32)
    b = np.asarray(jax.device_get(node[path[-1] + LORA_B]), np.float32)
    if m.config.scan_layers:
      for layer in range(m.config.layers):
        out[tensor_name(kind, layer)] = (a[layer], b[layer])
    else:
      out[tensor_name(kind, int(path[0].split("_")[1]))] = (a, b)
  return out


__all__ = [
  "DEFAULT_TARGETS",
  "KINDS",
  "LoraSpec",
  "adapter_sites",
  "adapters_of",
  "check_expert_targets",
  "file_kinds",
  "has_adapters",
  "lora_model",
  "with_lora",
]
