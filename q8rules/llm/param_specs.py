"""The param tree `load_gguf` fills, in shapes and dtypes, from the file's tensors alone.

`traced_params` is the reference: `jax.eval_shape` of the quantized `Transformer`'s init,
each float leaf given its file dtype. It traces the whole model once (a layer under
`nn.scan`, the embedding and the head, with Qwix's interceptions): 0.27-0.39 s of a load
on the 2-core CPU of benchmarks/RESULTS.md's decode tables, more than reading a 135M model's
file.

`file_params` builds the same tree without tracing: `load_gguf`'s model is the `Transformer`
quantized by `q8_rule(q8_paths)`, and each of its params is one of the file's tensors at the
path `tensor_slots` gives it (the assignment is strict both ways, so the tree has exactly
those leaves). Every Q8 param of that model is a Dense kernel or the embedding table: a
(K, N) float32 matrix contracted along axis 0, stored by `Q8Provider` as a `Q8Weight`
(values (K, N) int8, scales (K/32, N) in the rule's scale dtype) named by its param path; or a
stack of experts (E, K, N) through `jax.lax.ragged_dot` (values (E, K, N), scales
(E, K/32, N), each expert blocked along its own K, the expert axis a batch axis);
under `nn.scan` the leaves are stacked along a leading layer axis and keep one layer's
aux data. tests/test_param_specs.py checks that the two trees are equal, aux data included,
for every arch `load_gguf` supports, fused and not, scanned and unrolled, in both dtypes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from q8rules.layout import Q8How, WeightLayout
from q8rules.models.transformer import TransformerConfig, init_cache
from q8rules.providers import Q8Provider
from q8rules.providers.q8_weight import Q8Weight
from q8rules.q8_0 import Q8Array

PARAM_DTYPE = np.dtype(np.float32)
"""The float dtype of every `Transformer` param a Q8 rule serves (Dense kernels, the table)."""


def file_params(
  tensors: Any,
  names: Mapping[str, tuple[str, ...]],
  q8_paths: Collection[tuple[str, ...]],
  scale_dtype: Any = np.float16,
) -> dict[str, Any]:
  """The param tree (`params`, without the 'params' collection key) of the loader's model.

  Args:
    tensors: the tensors as the model reads them (`StackedTensors`: `spec(name)` gives a
      Q8Array or an array-like of the kernel layout's shapes, stacked where scanned).
    names: tensor name -> param path (`StackedTensors.name_map`).
    q8_paths: the param paths the Q8 rule serves.
    scale_dtype: the rule's scale dtype.

  Returns:
    Nested dicts of `jax.ShapeDtypeStruct`s (float params in their file dtype) and
    `Q8Weight`s of ShapeDtypeStructs, as `traced_params` gives them.
  """
  served = set(map(tuple, q8_paths))
  scale_dtype = np.dtype(scale_dtype)
  tree: dict[str, Any] = {}
  for name, path in names.items():
    spec = tensors.spec(name)
    if path in served and isinstance(spec, Q8Array):
      layout = _layout(tuple(spec.q.shape[1:] if path[0] == "layers" else spec.q.shape))
      how = Q8How(layout, scale_dtype.name, PARAM_DTYPE.name)
      array = Q8Array(
        q=jax.ShapeDtypeStruct(tuple(spec.q.shape), jnp.int8),
        scale=jax.ShapeDtypeStruct(tuple(spec.scale.shape), scale_dtype),
        axis=layout.blocked_axis,
        dtype=PARAM_DTYPE,
      )
      leaf: Any = Q8Weight(array=array, how=how, name="/".join(path))
    else:
      shape = spec.q.shape if isinstance(spec, Q8Array) else spec.shape
      leaf = jax.ShapeDtypeStruct(tuple(shape), PARAM_DTYPE if path in served else spec.dtype)
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return tree


def _layout(shape: tuple[int, ...]) -> WeightLayout:
  """One layer's weight layout: a (K, N) kernel, or a stack of experts (E, K, N) contracted
  along K, the expert axis a batch axis (`jax.lax.ragged_dot`'s layout)."""
  if len(shape) == 3:
    return WeightLayout(shape, (1,), (2,), (0,))
  return WeightLayout(shape, (0,), (1,))


def traced_params(
  model: nn.Module,
  provider: Q8Provider | None,
  config: TransformerConfig,
  tensors: Any,
  names: Mapping[str, tuple[str, ...]],
) -> Any:
  """The reference for `file_params`: `jax.eval_shape` of the model's init (nothing allocated;
  the provider makes Q8 params of the right shapes without tracing its quantizer), each float
  leaf in its file dtype."""
  ids = jnp.zeros((1, 1), jnp.int32)
  with provider.shapes_only() if provider is not None else contextlib.nullcontext():
    params = jax.eval_shape(model.init, jax.random.key(0), ids, init_cache(config, 1), 0)
  params = params["params"]
  by_path = {path: name for name, path in names.items()}

  def file_dtype(path: tuple[Any, ...], leaf: Any) -> Any:
    keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    name = by_path.get(keys)
    if name is None or isinstance(leaf, Q8Array) or not isinstance(leaf, jax.ShapeDtypeStruct):
      return leaf
    spec = tensors.spec(name)
    return leaf if isinstance(spec, Q8Array) else jax.ShapeDtypeStruct(leaf.shape, spec.dtype)

  return jax.tree_util.tree_map_with_path(
    file_dtype, params, is_leaf=lambda x: isinstance(x, Q8Array)
  )


__all__ = ["PARAM_DTYPE", "file_params", "traced_params"]
