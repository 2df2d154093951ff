"""`quantize_params`: float checkpoint params in, Q8 params out, without running the model
(as `qwix.quantize_params`)."""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from q8rules._qwix import WithAux, get_value_from_path, unbox
from q8rules.layout import Q8How
from q8rules.providers.q8_weight import quantize_weight
from q8rules.q8_0 import Q8Array, checked_finite
from q8rules.tree_paths import listing, path_str


def _quantize_stacked(w: jax.Array, how: Q8How, name: str, *, check_finite: bool) -> Q8Array:
  """`quantize_weight`, vmapped over leading axes that a lifted transform (`nn.scan`,
  `nn.vmap`) stacked the per-layer weight along: (*L, *how.layout.shape) -> Q8Array
  of q (*L, K_padded, N), as the Q8 model's own init makes it."""

  def f(a: jax.Array) -> Q8Array:
    return quantize_weight(a, how, name=name, check_finite=check_finite)

  extra = w.ndim - len(how.layout.shape)
  if extra > 0 and tuple(w.shape[extra:]) == how.layout.shape:
    for _ in range(extra):
      f = jax.vmap(f)
  return f(w)


def _param_paths(abstract_quantized_params: Any) -> set[tuple[Any, ...]]:
  """The paths of every param leaf of the Q8 model (a Q8 weight counts as one leaf)."""
  if isinstance(abstract_quantized_params, nnx.Module):
    paths = set()
    for path, node in nnx.iter_graph(abstract_quantized_params):
      if isinstance(node, nnx.Param):
        # nnx keeps a WithAux's parts as Params at .../kernel/array/{q,scale}
        if len(path) > 2 and path[-2] == "array" and path[-1] in ("q", "scale"):
          path = path[:-2]
        paths.add(tuple(path))
    return paths
  if isinstance(abstract_quantized_params, nnx.State):
    abstract_quantized_params = nnx.to_pure_dict(abstract_quantized_params)
  return set(flax.traverse_util.flatten_dict(abstract_quantized_params))


def _as_dict(params: Any) -> Any:
  """A float param tree as nested dicts of arrays: an nnx.State (or a dict holding nnx
  Variables) becomes its pure dict."""
  if isinstance(params, nnx.State):
    return nnx.to_pure_dict(params)
  return jax.tree.map(
    lambda v: v[...] if isinstance(v, nnx.Variable) else v,
    params,
    is_leaf=lambda v: isinstance(v, nnx.Variable),
  )


def _names(paths: Any) -> str:
  """Param paths (tuples of keys), sorted, as an indented listing."""
  return listing(sorted(path_str(p) for p in paths))


def quantize_params(
  params: Any,
  abstract_quantized_params: Any,
  *,
  allow_extra_params: bool = False,
) -> Any:
  """Float checkpoint params in, Q8 params out, without running the model.

  Like `qwix.quantize_params`.

  Args:
    params: the float param tree (linen: unboxed `variables['params']`; nnx:
      `nnx.state(model)` or `nnx.state(model, nnx.Param)`, as an `nnx.State` or
      its pure dict).
    abstract_quantized_params: the param tree of the Q8 model (linen: from
      `init`, possibly under `jax.eval_shape`), or the Q8 nnx model itself.
    allow_extra_params: skip float params the Q8 model does not have.

  Returns:
    The param tree with every weight the Q8 model serves as Q8_0 replaced by
    `WithAux(Q8Array, Q8How)`, other leaves as given (nnx: a pure dict, for
    `nnx.update(q8_model, ...)`).

  Raises:
    ValueError: a param of the Q8 model that `params` lacks (naming every one,
      and every float param the model does not have), or a float param the Q8
      model does not have (unless `allow_extra_params`).
  """
  flat = flax.traverse_util.flatten_dict(_as_dict(params))
  found = {path: get_value_from_path(abstract_quantized_params, path) for path in flat}
  extra = [path for path, v in found.items() if v is None]
  missing = _param_paths(abstract_quantized_params) - set(flat)
  if missing or (extra and not allow_extra_params):
    problems = []
    if missing:
      problems.append(
        f"the float params lack {len(missing)} param(s) of the quantized model:\n{_names(missing)}"
      )
    if extra:
      problems.append(
        f"{len(extra)} float param(s) are not in the quantized model's params:\n{_names(extra)}"
      )
    raise ValueError("quantize_params: " + "\n".join(problems))
  quantized = {}
  for path, param in flat.items():
    abs_param = found[path]
    if abs_param is None:
      continue
    abs_param = unbox(abs_param)
    if isinstance(abs_param, WithAux) and isinstance(abs_param.how, Q8How):
      name = path_str(path)
      param = jnp.asarray(param)
      traced = isinstance(param, jax.core.Tracer)
      if not traced:  # checked once, here: a clear ValueError, not a run-time callback per layer
        checked_finite(param, name)
      q8 = _quantize_stacked(param, abs_param.how, name, check_finite=traced)
      param = abs_param.replace(array=q8)
    quantized[path] = param
  if isinstance(abstract_quantized_params, nnx.Module):
    quantized = nnx.to_pure_dict(nnx.state(quantized))
  return flax.traverse_util.unflatten_dict(quantized)


__all__ = ["quantize_params"]
