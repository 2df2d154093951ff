"""Every Qwix name q8rules uses, imported from one place (tested with qwix 0.1.8).

Public names come from `qwix`; the rest are the few internals a provider built
on `qwix.PtqProvider` needs, each behind a named function here: the param
container `WithAux`, the rule and op id of the op being intercepted
(`current_rule_and_op_id`), the provider's rules and whether its first run is
done, the names of Qwix's own interceptions (`PLUMBING_INTERCEPTIONS`), and
Flax helpers that find the module being run, its params and the param an
operand is. A Qwix upgrade that moves them breaks this file only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from qwix import PtqProvider, QuantizationProvider, QuantizationRule, quantize_model
from qwix._src import interception as _interception
from qwix._src.utils import flax_util as _flax_util

try:  # Qwix after 0.1.8: the boxed param and its swap moved out of ptq.py
  from qwix._src.providers import boxed_param as _boxed
except ImportError:  # qwix 0.1.8
  from qwix._src.providers import ptq as _boxed

WithAux = _boxed.WithAux
"""Qwix's param container: `WithAux(array, how)`; the `how` rides in the tree as static data."""

GET_CURRENT_RULE = "qwix._src.qconfig.get_current_rule"
"""The interception every Qwix provider installs so Qwix's own ops can ask for their rule."""

PALLAS_CALL = "jax.experimental.pallas.pallas_call"
"""The interception that turns interception off inside Pallas kernels."""

PLUMBING_INTERCEPTIONS = frozenset(
  {
    "flax.linen.Module.param",
    "flax.linen.dtypes.promote_dtype",
    "flax.nnx.nn.dtypes.promote_dtype",
    GET_CURRENT_RULE,
    PALLAS_CALL,
  }
)
"""Interceptions of `qwix.PtqProvider` that are not products (param creation, dtype promotion,
rule lookup, Pallas): a provider keeps them as Qwix has them."""

find_param = _flax_util.find_param
"""The name of the current module's param an operand is ('' or None when it is not one)."""

unbox = _flax_util.unbox
"""A Flax boxed param (or nnx Variable) without its box."""

get_value_from_path = _flax_util.get_value_from_path
"""The leaf at a path of a param tree or an nnx module (None when absent)."""


get_attribute = _interception.get_attribute
"""The object at a dotted path, e.g. 'jax.lax.conv_general_dilated' (how Qwix names the ops it
intercepts). Called from inside a provider's handler it runs the original function: Qwix's
interception does not recurse."""


has_attribute = _interception.has_attribute
"""Whether the object at a dotted path exists (an interception of a missing one fails)."""


make_rng = _flax_util.make_rng
"""A random key from a stream ('dropout') of the module being run (linen: `make_rng`; nnx: the
`qwix_rngs` that `qwix.apply_lora_to_model(..., rngs=...)` sets)."""


get_or_create_param = _flax_util.get_or_create_param
"""The current module's param `name`, created by `init_fn(rng)` when absent (nnx: as
`nnx_param_type`, e.g. `nnx.LoRAParam`); returned unboxed."""


get_current_module = _flax_util.get_current_module
"""The Flax module (linen or nnx) whose code is running; ValueError when there is none."""


def module_params(module: Any) -> dict[str, Any]:
  """The module's own params by name, boxed as stored: a linen module's 'params' collection,
  an nnx module's `nnx.Param` and `WithAux` attributes (where Qwix's `find_param` looks)."""
  if isinstance(module, nnx.Module):
    return {k: v for k, v in vars(module).items() if isinstance(v, nnx.Param | WithAux)}
  return dict(module.scope._collection("params"))  # noqa: SLF001 (Qwix's own lookup)


def current_module_path() -> str:
  """The Flax module path of the op being intercepted ('' for the top module)."""
  return "/".join(map(str, _flax_util.get_current_module_path()))


def is_with_aux(x: Any) -> bool:
  """Whether `x` (boxed or not) is a Qwix `WithAux`."""
  return isinstance(unbox(x), WithAux)


def current_rule_and_op_id(
  provider: QuantizationProvider, op: str
) -> tuple[QuantizationRule | None, str]:
  """The rule (of `provider`'s, the first matching the current module path and `op`, or None)
  and the op id ('dot_general0', counted per module) of the op `provider` is intercepting.

  Counts the op: call once per intercepted op."""
  return provider._get_current_rule_and_op_id(op)


def provider_rules(provider: QuantizationProvider) -> Sequence[QuantizationRule]:
  """The rules `provider` matches ops against, in order (as `current_rule_and_op_id` returns
  them)."""
  return provider._rules


def initial_run_complete(provider: QuantizationProvider) -> bool:
  """Whether a model run through `provider` has returned once (`get_unused_rules` is final)."""
  return provider._initial_run_complete


__all__ = [
  "GET_CURRENT_RULE",
  "PALLAS_CALL",
  "PLUMBING_INTERCEPTIONS",
  "PtqProvider",
  "QuantizationProvider",
  "QuantizationRule",
  "WithAux",
  "current_module_path",
  "current_rule_and_op_id",
  "find_param",
  "get_attribute",
  "get_current_module",
  "get_or_create_param",
  "get_value_from_path",
  "has_attribute",
  "initial_run_complete",
  "is_with_aux",
  "make_rng",
  "module_params",
  "provider_rules",
  "quantize_model",
  "unbox",
]


def derives_unchanged(x: Any, param: Any) -> bool:
  """Whether `x` is the param's value `param` itself, or it through ops that leave its values
  as they are: traced, a chain of one-operand primitives back to it (Flax's sharding constraint
  on a partitioned param, which Qwix's `find_param` walks the same way); concrete, equal to it
  in shape, dtype and every value. Qwix's last resort, a param of the same shape, is not
  taken."""
  if x is param:
    return True
  if isinstance(x, jax.core.Tracer):
    while hasattr(x, "parent") and x.parent is not None and len(x.parent.in_tracers) == 1:
      x = x.parent.in_tracers[0]
      if x is param:
        return True
    return False
  if isinstance(param, jax.core.Tracer) or not hasattr(x, "shape"):
    return False
  same = tuple(x.shape) == tuple(param.shape) and x.dtype == param.dtype
  return bool(same and np.array_equal(np.asarray(x), np.asarray(param)))
