"""A primitive lowered per platform: the lowering platforms, each lowered through `run_on`
for its own platform (`lower_per_platform`), and the float32-result primitive the products
are (`float32_primitive`: shape rule, eager impl and lowerings in one call).

`run_on(platform, *operands, **params)` is an op's computation as `platform` ('cpu', 'gpu',
'tpu') runs it, which calls `registry.resolve` for that platform: one `jax.export` artifact
lowered for several platforms runs each one's own implementation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from q8rules.kernels.problem import PLATFORM_OF
from q8rules.kernels.registry import jit_impl

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""The platforms a primitive is lowered for."""


def lower_per_platform(primitive: Primitive, run_on: Callable[..., jax.Array]) -> None:
  """Register `primitive`'s lowering for each of `LOWERING_PLATFORMS` as `run_on` with that
  platform ('cuda' and 'rocm' as 'gpu') bound first; `run_on` returns one array."""
  for lp in LOWERING_PLATFORMS:
    rule = mlir.lower_fun(functools.partial(run_on, PLATFORM_OF[lp]), multiple_results=False)
    mlir.register_lowering(primitive, rule, platform=lp)


def float32_primitive(
  name: str, out_shape: Callable[..., tuple[int, ...]], run_on: Callable[..., jax.Array]
) -> Primitive:
  """A primitive named `name` whose result is float32 of shape `out_shape(*operands)` (the
  operands' abstract values), run eagerly through `registry.jit_impl` and lowered per
  platform through `run_on` (`lower_per_platform`)."""
  primitive = Primitive(name)

  def abstract_eval(*operands: Any, **params: Any) -> jax.core.ShapedArray:
    del params
    return jax.core.ShapedArray(out_shape(*operands), jnp.float32)

  primitive.def_abstract_eval(abstract_eval)
  primitive.def_impl(jit_impl(primitive))
  lower_per_platform(primitive, run_on)
  return primitive


__all__ = ["LOWERING_PLATFORMS", "float32_primitive", "lower_per_platform"]
