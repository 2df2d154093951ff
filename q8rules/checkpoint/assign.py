"""Put loaded tensors into a quantized model's param tree, checking every one.

    ckpt = q8rules.checkpoint.gguf.load("model.gguf")
    params = assign(q8_params, ckpt, {"blk.0.ffn_up.weight": ("params", "layers_0", "up", "kernel")})

Param paths follow `q8rules.tree_paths`: a tuple of str, one per dict
key (or list index, or attribute name) from the root of the tree you pass,
with the wrapper attributes `array` (qwix's `WithAux`) and `value` (Flax's
boxed params) skipped. The Q8Array at
`{'params': {'layers_0': {'mlp': {'kernel': WithAux(array=Q8Array, how)}}}}` is at
`('params', 'layers_0', 'mlp', 'kernel')`; pass `variables['params']` instead
and it is at `('layers_0', 'mlp', 'kernel')`. A path may also be given as a
dotted str, `'layers_0.mlp.kernel'`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from q8rules.checkpoint import shards
from q8rules.checkpoint._common import (
  CheckpointError,
  flatten_params,
  progress_iter,
  shape_dtype,
)
from q8rules.checkpoint.reader import as_reader
from q8rules.q8_0 import Q8Array
from q8rules.tree_paths import ParamPath, listing, path_str

NameMap = Mapping[str, "Sequence[str] | str"] | Callable[[str], "Sequence[str] | str | None"]
"""GGUF (or checkpoint) name -> param path; a callable may return None to skip a tensor."""


def _as_path(dest: Sequence[str] | str) -> ParamPath:
  if isinstance(dest, str):
    return tuple(dest.split("."))
  return tuple(str(k) for k in dest)


def _describe(x: Any) -> str:
  if isinstance(x, Q8Array):
    q, qd = shape_dtype(x.q)
    s, sd = shape_dtype(x.scale)
    return f"Q8Array(q {q} {qd.name}, scale {s} {sd.name}, axis {x.axis % max(len(q), 1)})"
  shape, dtype = shape_dtype(x)
  return f"array {shape} {dtype.name}"


def _mismatch(leaf: Any, spec: Any) -> str | None:
  """Why `spec` cannot go where `leaf` is, or None if it can."""
  if isinstance(leaf, Q8Array):
    if not isinstance(spec, Q8Array):
      return "the param is Q8_0 but the tensor is not quantized"
    (lq, _), (ls, lsd) = shape_dtype(leaf.q), shape_dtype(leaf.scale)
    (tq, tqd), (ts, tsd) = shape_dtype(spec.q), shape_dtype(spec.scale)
    if tq != lq:
      return f"q shape {tq} != {lq}"
    if ts != ls:
      return f"scale shape {ts} != {ls}"
    rank = max(len(lq), 1)
    if leaf.axis % rank != spec.axis % rank:
      return f"blocked along axis {spec.axis % rank}, the param along {leaf.axis % rank}"
    if tqd != np.int8:
      return f"q dtype {tqd.name}, not int8"
    if tsd not in (np.float16, np.float32) or lsd not in (np.float16, np.float32):
      return f"scale dtype {tsd.name} for a param scale of {lsd.name}"
    return None
  if isinstance(spec, Q8Array):
    return "the tensor is Q8_0 but the param is a float array (the model does not quantize it)"
  (ls, ld), (ts, td) = shape_dtype(leaf), shape_dtype(spec)
  if ts != ls:
    return f"shape {ts} != {ls}"
  floats = jnp.issubdtype(ld, jnp.floating) and jnp.issubdtype(td, jnp.floating)
  if not floats and ld != td:
    return f"dtype {td.name} for a param of {ld.name}"
  return None


def _place(value: np.ndarray, leaf: Any) -> Any:
  """`value` where `leaf` lives: a jax.Array on the leaf's sharding, numpy for numpy. A
  sharding over several processes gets this process's shards only (the same `value` on each)."""
  if isinstance(leaf, np.ndarray):
    return value
  sharding = _sharding(leaf)
  if sharding is None:  # a transfer (jnp.asarray would compile a conversion per new shape)
    return jax.device_put(value)
  if sharding.is_fully_addressable:
    return jax.device_put(value, sharding)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _sharding(leaf: Any) -> Any:
  """The sharding a jax.Array / ShapeDtypeStruct leaf lives on, or None."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
    return getattr(leaf, "sharding", None)
  return None


def _shardwise(leaf: Any) -> bool:
  """Whether the leaf's value is built shard by shard from the reader's `read_region`: a leaf
  on a sharding (of a Q8Array, q's)."""
  return _sharding(leaf.q if isinstance(leaf, Q8Array) else leaf) is not None


def _convert(leaf: Any, value: Any, what: str) -> Any:
  """The tensor in the leaf's dtypes, placed like the leaf."""
  if isinstance(leaf, Q8Array):
    q = np.asarray(value.q)
    scale = np.asarray(value.scale)
    scale_dtype = shape_dtype(leaf.scale)[1]
    if scale.dtype != scale_dtype:
      new = scale.astype(scale_dtype)
      if scale_dtype.itemsize < scale.dtype.itemsize and not np.array_equal(
        new.astype(scale.dtype), scale
      ):
        raise CheckpointError(
          f"{what}: the param keeps {scale_dtype.name} scales but the tensor's"
          f" {scale.dtype.name} scales are not all {scale_dtype.name} values"
        )
      scale = new
    return Q8Array(
      q=_place(q, leaf.q), scale=_place(scale, leaf.scale), axis=leaf.axis, dtype=leaf.dtype
    )
  dtype = shape_dtype(leaf)[1]
  return _place(np.asarray(value).astype(dtype, copy=False), leaf)


def flatten(params: Any) -> dict[str, Any]:
  """A param tree as a flat dict: dotted param path -> leaf (Q8Arrays whole, wrappers
  skipped), e.g. `{'layers_0.mlp.kernel': Q8Array, ...}`.

  With it, a tree of plain dicts (as `checkpoint.safetensors.load` gives) goes
  into a template with wrappers: `assign(template, flatten(tree), lambda n: n)`.
  """
  return {".".join(path): leaf for path, leaf in flatten_params(params)[0]}


def assign(
  q8_params: Any,
  tensors: Mapping[str, Any],
  name_map: NameMap,
  *,
  strict: bool = True,
  progress: bool | None = None,
) -> Any:
  """A copy of `q8_params` with leaves replaced by `tensors`, by `name_map`.

  Every destination is checked before any tensor is read (a `GGUFCheckpoint`
  is asked for shapes only), then the tensors are read one by one; on any
  error nothing is returned and `q8_params` is untouched.

  Args:
    q8_params: the quantized model's param tree (e.g. from `init`, or
      `jax.eval_shape` of it): nested dicts whose leaves are arrays or
      `Q8Array`s, possibly inside qwix `WithAux` or Flax boxes.
    tensors: name -> `Q8Array` or array, e.g. a `GGUFCheckpoint` (layout
      'kernel', matching the provider's (K, N) Q8 params) or a dict.
    name_map: a dict from tensor name to param path (tuple of str, or a
      dotted str), or a callable from tensor name to path, or None to skip it.
    strict: raise when a param leaf gets no tensor ("missing"), when a tensor
      has no destination ("left over"), or when a dict name map names a tensor
      that `tensors` does not have. With strict=False those leaves keep their
      values and those tensors are ignored. Shape and type checks, unknown
      destinations and two tensors for one param are errors either way.
    progress: a tqdm bar over tensors (None: on when more than 16 and stderr is
      a terminal).

  Returns:
    The new tree, same structure (and `WithAux.how`) as `q8_params`. A Q8Array
    leaf gets the tensor's `q` and `scale` (its scale converted to the leaf's
    scale dtype: float16 -> float32 always, float32 -> float16 only when exact)
    and keeps the leaf's `axis` and `dtype`; a float leaf gets the array cast
    to its dtype (e.g. F32 -> bfloat16 rounds). Values go where the leaf is: a
    jax.Array leaf (or a ShapeDtypeStruct with a sharding) gives a jax.Array
    on its sharding, a numpy leaf a numpy array, anything else a jax.Array on
    the default device. A leaf on a sharding, with `tensors` that can read regions
    (`read_region(name, index)`, as `GGUFCheckpoint`), gets each shard its process's
    devices hold read on its own: over several processes no process reads (or holds)
    another's shards.

  Raises:
    CheckpointError: listing every problem found: missing params, left-over
      tensors, unknown paths, shape/dtype/quantization mismatches.
  """
  pairs, treedef = flatten_params(q8_params)
  index: dict[ParamPath, int] = {}
  for i, (path, _) in enumerate(pairs):
    if path in index:
      raise CheckpointError(f"two param leaves share the path {path_str(path)}")
    index[path] = i

  problems: list[str] = []
  claimed: dict[int, str] = {}  # leaf index -> tensor name, fitting or not
  targets: dict[int, str] = {}  # leaf index -> tensor name, checked
  left_over: list[str] = []
  reader = as_reader(tensors)
  for name in reader:
    dest = name_map(name) if callable(name_map) else name_map.get(name)
    if dest is None:
      left_over.append(name)
      continue
    path = _as_path(dest)
    i = index.get(path)
    if i is None:
      problems.append(f"tensor {name!r} -> {path_str(path)}: no such param leaf")
      continue
    if i in claimed:
      problems.append(f"tensors {claimed[i]!r} and {name!r} both go to {path_str(path)}")
      continue
    claimed[i] = name
    spec = reader.spec(name)
    why = _mismatch(pairs[i][1], spec)
    if why is not None:
      problems.append(
        f"tensor {name!r} ({_describe(spec)}) -> {path_str(path)} ({_describe(pairs[i][1])}): {why}"
      )
      continue
    targets[i] = name
  if strict:
    if not callable(name_map):
      absent = [repr(n) for n in name_map if n not in reader]
      if absent:
        problems.append(
          f"{len(absent)} name(s) in the name map are not among the tensors:\n{listing(absent)}"
        )
    missing = [path_str(p) for i, (p, _) in enumerate(pairs) if i not in claimed]
    if missing:
      problems.append(f"{len(missing)} param leaf(s) get no tensor:\n{listing(missing)}")
    if left_over:
      problems.append(
        f"{len(left_over)} tensor(s) have no destination in the name map:\n"
        + listing([repr(n) for n in left_over])
      )
  if problems:
    where = f"{reader.path}: " if reader.path is not None else ""
    raise CheckpointError(f"{where}cannot assign the tensors:\n" + "\n".join(problems))

  leaves = [leaf for _, leaf in pairs]
  for i, name in progress_iter(
    list(targets.items()), total=len(targets), desc="assigning", progress=progress
  ):
    what = f"tensor {name!r} -> {path_str(pairs[i][0])}"
    if _shardwise(pairs[i][1]):
      # each process reads the byte ranges of its own devices' shards (checkpoint/shards.py)
      leaves[i] = shards.assemble(
        pairs[i][1], lambda index, name=name: shards.read_region(reader, name, index), what
      )
      continue
    value = reader[name]
    got = _mismatch(pairs[i][1], value)  # what was read must match what was announced
    if got is not None:
      raise CheckpointError(f"{what}: {got}")
    leaves[i] = _convert(pairs[i][1], value, what)
  return jax.tree_util.tree_unflatten(treedef, leaves)
