"""Every Qwix name q8rules uses, imported from one place (tested with qwix 0.1.8).

Public names come from `qwix`; the rest are the few internals a provider built
on `qwix.PtqProvider` needs (the param container `WithAux`, the param swap
`create_quantized_param`, and Flax helpers that find the module being run and
the param an operand is). A Qwix upgrade that moves them breaks this file only.
"""

from __future__ import annotations

from typing import Any

from qwix import PtqProvider, QuantizationProvider, QuantizationRule, quantize_model
from qwix._src import interception as _interception
from qwix._src.providers import ptq as _ptq
from qwix._src.utils import flax_util as _flax_util

WithAux = _ptq.WithAux
"""Qwix's param container: `WithAux(array, how)`; the `how` rides in the tree as static data."""

create_quantized_param = _ptq.create_quantized_param
"""Swap a float param of the current module for `WithAux(quantize(value, how), how)`."""

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


def current_module_path() -> str:
  """The Flax module path of the op being intercepted ('' for the top module)."""
  return "/".join(map(str, _flax_util.get_current_module_path()))


def is_with_aux(x: Any) -> bool:
  """Whether `x` (boxed or not) is a Qwix `WithAux`."""
  return isinstance(unbox(x), WithAux)


__all__ = [
  "PtqProvider",
  "QuantizationProvider",
  "QuantizationRule",
  "WithAux",
  "create_quantized_param",
  "current_module_path",
  "find_param",
  "get_attribute",
  "get_value_from_path",
  "is_with_aux",
  "quantize_model",
  "unbox",
]
