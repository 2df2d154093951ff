"""LoRA adapters on a loaded GGUF model: `GGUFModel.with_lora`, keyed by the file's own tensors.

    m = q8rules.load_gguf("model.gguf").with_lora(rank=16, alpha=32.0)

gives each targeted weight matrix of every layer (by GGUF tensor kind: `attn_q`, `attn_k`,
`attn_v`, `attn_output`, `ffn_gate`, `ffn_up`, `ffn_down`; `attn_qkv` where the file itself
fuses q | k | v) a trainable adapter A (K, rank), B (rank, N) on its frozen Q8_0 base, served by
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
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint.gguf import open_gguf
from q8rules.llm.tensors import q8_rule
from q8rules.llm.unstack import rebuilt
from q8rules.models.transformer import Transformer
from q8rules.providers.lora import Q8LoraProvider, Q8LoraRule
from q8rules.providers.lora_merge import merged_q8
from q8rules.providers.lora_params import LoraAdapter, placed_like
from q8rules.providers.placement import placed_sharding
from q8rules.providers.q8_weight import Q8Weight
from q8rules.q8_0 import Q8Array
from q8rules.sharding.adapters import LORA_A, LORA_B, adapter_spec

KINDS: dict[str, tuple[str, str]] = {
  "attn_q": ("attn", "q"),
  "attn_k": ("attn", "k"),
  "attn_v": ("attn", "v"),
  "attn_qkv": ("attn", "qkv"),
  "attn_output": ("attn", "o"),
  "ffn_gate": ("mlp", "gate"),
  "ffn_up": ("mlp", "up"),
  "ffn_down": ("mlp", "down"),
}
"""GGUF tensor kind (`blk.N.<kind>.weight`) -> (block module, Dense module) in the Transformer."""

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

_GROUPS = (
  ("attn", "qkv", ("attn_q", "attn_k", "attn_v"), "fused_qkv"),
  ("mlp", "up", ("ffn_gate", "ffn_up"), "fused_gate_up"),
)
"""Groups `load_gguf` fuses: (block module, fused module, member kinds in column order, config
field)."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """The adapters of a `GGUFModel` (`GGUFModel.lora`).

  Attributes:
    rank: r of every adapter.
    alpha: the delta's scale is alpha / rank.
    targets: the GGUF tensor kinds adapted, in `KINDS`' order.
    dropout: the dropout rate on x before A in training (`q8rules.llm.finetune`); serving
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


def layer_roots(config: Any) -> list[str]:
  """The params' block roots: ['layers'] (scanned: stacked) or ['layers_0', ...]."""
  return ["layers"] if config.scan_layers else [f"layers_{i}" for i in range(config.layers)]


def kernel_path(root: str, kind: str) -> tuple[str, str, str, str]:
  block, module = KINDS[kind]
  return (root, block, module, "kernel")


def get_in(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
  node: Any = tree
  for key in path:
    node = node[key]
  return node


def set_in(tree: dict[str, Any], path: Sequence[str], value: Any) -> dict[str, Any]:
  """A copy of the nested dicts along `path` with the leaf set (other branches shared)."""
  out = dict(tree)
  if len(path) == 1:
    out[path[0]] = value
    return out
  out[path[0]] = set_in(dict(out.get(path[0], {})), path[1:], value)
  return out


def _columns(leaf: Any, start: int, stop: int, name: str) -> Any:
  """Columns [start, stop) of a (..., K, N) param: a Q8 param's values and scales (blocks run
  along K, so no block changes), or a float kernel / bias (last axis)."""
  if isinstance(leaf, Q8Weight):
    arr = leaf.array
    sliced = dataclasses.replace(arr, q=arr.q[..., start:stop], scale=arr.scale[..., start:stop])
    layout = leaf.how.layout
    how = dataclasses.replace(
      leaf.how, layout=dataclasses.replace(layout, shape=(*layout.shape[:-1], stop - start))
    )
    return dataclasses.replace(leaf, array=sliced, how=how, name=name)
  return leaf[..., start:stop]


def _sizes(config: Any) -> dict[str, int]:
  return {
    "attn_q": config.heads * config.head_dim,
    "attn_k": config.kv_heads * config.head_dim,
    "attn_v": config.kv_heads * config.head_dim,
    "ffn_gate": config.ffn,
    "ffn_up": config.ffn,
  }


def unfuse(
  config: Any, params: Any, targets: Sequence[str], present: set[str]
) -> tuple[Any, Any, tuple[str, ...]]:
  """`config` and `params` with each load-fused group that has a targeted member split back into
  its members (see the module), and the config fields of the groups split. A group the file
  itself fuses stays as it is."""
  sizes, split = _sizes(config), []
  for block, fused, members, field in _GROUPS:
    if not getattr(config, field) or not set(members) & set(targets):
      continue
    if not set(members) <= present:  # the file's own fused tensor (phi3): keep it
      continue
    for root in layer_roots(config):
      node = get_in(params, (root, block))
      fused_module = node[fused]
      new_block = {k: v for k, v in node.items() if k != fused}
      start = 0
      for kind in members:
        stop = start + sizes[kind]
        module = KINDS[kind][1]
        new_block[module] = {
          leaf: _columns(value, start, stop, f"{root}/{block}/{module}/{leaf}")
          for leaf, value in fused_module.items()
        }
        start = stop
      params = set_in(params, (root, block), new_block)
    config = dataclasses.replace(config, **{field: False})
    split.append(field)
  return config, params, tuple(split)


def _joined(parts: Sequence[Any], name: str) -> Any:
  """The column concatenation of `parts` (Q8 params or float arrays), as one param `name`."""
  first = parts[0]
  if isinstance(first, Q8Weight):
    q = jnp.concatenate([p.array.q for p in parts], axis=-1)
    scale = jnp.concatenate([p.array.scale for p in parts], axis=-1)
    layout = first.how.layout
    n = sum(p.how.layout.shape[-1] for p in parts)
    how = dataclasses.replace(
      first.how, layout=dataclasses.replace(layout, shape=(*layout.shape[:-1], n))
    )
    array = dataclasses.replace(first.array, q=q, scale=scale)
    return dataclasses.replace(first, array=array, how=how, name=name)
  return jnp.concatenate(parts, axis=-1)


def refuse(config: Any, params: Any, fields: Sequence[str]) -> tuple[Any, Any]:
  """The inverse of `unfuse`: the groups of `fields` concatenated back into one param each."""
  for block, fused, members, field in _GROUPS:
    if field not in fields:
      continue
    modules = [KINDS[k][1] for k in members]
    for root in layer_roots(config):
      node = get_in(params, (root, block))
      new_block = {k: v for k, v in node.items() if k not in modules}
      leaves = node[modules[0]].keys()
      new_block[fused] = {
        leaf: _joined([node[m][leaf] for m in modules], f"{root}/{block}/{fused}/{leaf}")
        for leaf in leaves
      }
      params = set_in(params, (root, block), new_block)
    config = dataclasses.replace(config, **{field: True})
  return config, params


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


def _placed_like_base(value: jax.Array, base: Any, which: str) -> jax.Array:
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
    k, n = base.how.layout.shape
    if spec.rank > min(k, n):
      raise ValueError(
        f"{where}: LoRA rank {spec.rank} exceeds min(K, N) = {min(k, n)} of {kind}"
        f" ({'/'.join(path)}: K={k}, N={n})"
      )
    lead = tuple(base.array.q.shape[:-2])
    keys = jax.random.split(jax.random.fold_in(key, i), max(1, math.prod(lead)))

    def one(k_: jax.Array, k=k) -> jax.Array:
      return jnp.asarray(rule.lora_a_initializer(k_, (k, spec.rank), jnp.float32), jnp.float32)

    a = jax.vmap(one)(keys).reshape(*lead, k, spec.rank)
    b = jnp.zeros((*lead, spec.rank, n), jnp.float32)
    out[path] = (_placed_like_base(a, base, "a"), _placed_like_base(b, base, "b"))
  return out


def with_adapters(params: Any, adapters: Mapping[tuple[str, ...], tuple[Any, Any]]) -> Any:
  """`params` with each (A, B) set beside its kernel path as `kernel_lora_a` / `kernel_lora_b`."""
  for path, (a, b) in adapters.items():
    name = path[-1]
    params = set_in(params, (*path[:-1], name + LORA_A), a)
    params = set_in(params, (*path[:-1], name + LORA_B), b)
  return params


def lora_rule(config: Any, spec: LoraSpec, *, dropout: float = 0.0) -> Q8LoraRule:
  """The `Q8LoraRule` matching exactly the adapted modules (GGUF's float16 scales)."""
  roots = "layers" if config.scan_layers else r"layers_\d+"
  modules = "|".join(re.escape("/".join(KINDS[k])) for k in spec.targets)
  return Q8LoraRule(
    module_path=f"{roots}/(?:{modules})",
    rank=spec.rank,
    alpha=spec.alpha,
    dropout=dropout,
    scale_dtype=jnp.float16,
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
  m: Any,
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
  config, params, split = unfuse(m.config, m.params, spec.targets, present)
  spec = dataclasses.replace(spec, unfused=split)
  params = with_adapters(params, initial_adapters(config, params, spec, seed, m.path))
  model = lora_model(config, params, spec)
  return dataclasses.replace(m, config=config, model=model, params=params, lora=spec)


def adapters_of(m: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """The adapters of `m` per GGUF tensor: 'blk.3.attn_q.weight' -> (A (K, rank), B (rank, N)),
  float32 numpy, one layer each (a stacked adapter split by layer)."""
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


def attach_lora_files(m: Any, files: Sequence[Any], scales: Sequence[float]) -> Any:
  """`m` with the adapters of llama.cpp LoRA files (`q8rules.checkpoint.gguf.adapter.LoraFile`)
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
    file_ranks = {a.shape[1] for a, _ in f.adapters.values()}
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
      for f, r, lora_scale in zip(files, ranks, scales, strict=True):
        a, b = f.adapters.get(n, (None, None))
        if a is None:  # this file does not adapt the tensor: a zero delta of its rank
          a_parts.append(np.zeros((0, r), np.float32))
          b_parts.append(None)
          continue
        a_parts.append(a)
        b_parts.append((b * np.float32(f.scale(n, lora_scale))).astype(np.float32))
      k = next(a.shape[0] for a in a_parts if a.shape[0])
      n_out = next(b.shape[1] for b in b_parts if b is not None)
      a_parts = [a if a.shape[0] else np.zeros((k, a.shape[1]), np.float32) for a in a_parts]
      b_parts = [
        b if b is not None else np.zeros((r, n_out), np.float32)
        for b, r in zip(b_parts, ranks, strict=True)
      ]
      combined[n] = (np.concatenate(a_parts, axis=1), np.concatenate(b_parts, axis=0))
  kinds = {_site(n, m.config, present, "")[0] for n in combined}
  spec = LoraSpec(rank, alpha, tuple(k for k in KINDS if k in kinds))
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
    k, n = base.how.layout.shape
    layers = range(config.layers) if config.scan_layers else [int(path[0].split("_")[1])]
    a_all = np.zeros((len(layers), k, rank), np.float32)
    b_all = np.zeros((len(layers), rank, n), np.float32)
    for j, layer in enumerate(layers):
      name = tensor_name(kind, layer)
      if name not in combined:
        continue
      a, b = combined[name]
      if a.shape != (k, rank) or b.shape != (rank, n):
        raise CheckpointError(
          f"{[f.path for f in files]}: LoRA tensor {name!r}: A {a.shape} and B {b.shape} do not"
          f" fit the base's (K={k}, N={n}) at rank {rank} (wrong base model?)"
        )
      a_all[j], b_all[j] = a, b
    if not config.scan_layers:
      a_all, b_all = a_all[0], b_all[0]
    a_dev = _placed_like_base(jnp.asarray(a_all), base, "a")
    stacked[path] = (a_dev, _placed_like_base(jnp.asarray(b_all), base, "b"))
  params = with_adapters(params, stacked)
  model = lora_model(config, params, spec)
  return dataclasses.replace(m, config=config, model=model, params=params, lora=spec)


def merged(m: Any) -> Any:
  """`GGUFModel.merged`: each adapter folded into its Q8_0 base, layer by layer, as
  `q8rules.merge_lora` folds one (`W + alpha / rank * A @ B` summed in float64, rounded once to
  float32, requantized to Q8_0 with float16 scales), the load-fused groups fused again, served
  by a plain `Q8Provider`.

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
      one = Q8Array(q=q_all[j], scale=s_all[j], axis=0, dtype=base.array.dtype)
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
  config, params = refuse(m.config, params, m.lora.unfused)
  plain = rebuilt(m, config, params)
  return dataclasses.replace(plain, lora=None)


__all__ = [
  "DEFAULT_TARGETS",
  "KINDS",
  "LoraSpec",
  "adapters_of",
  "attach_lora_files",
  "file_kinds",
  "has_adapters",
  "lora_model",
  "merged",
  "with_lora",
]
