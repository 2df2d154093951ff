"""The Pallas names the fold kernels use, imported from one place (jax 0.10 to 0.12).

jax 0.11 deprecates the Triton backend (`pallas.triton`) in favour of Mosaic GPU;
it may warn on import, and the warning is silenced here. The plan for when it
goes is in docs/design.md ("Kernels and their platforms").
"""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as plgpu

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
"""The custom call a Pallas Triton kernel lowers to (checked by the lowering tests)."""

MOSAIC_CUSTOM_CALL = "tpu_custom_call"
"""The custom call a Pallas Mosaic TPU kernel lowers to."""


def triton_compiler_params(*, num_warps: int, num_stages: int) -> plgpu.CompilerParams:
  """Triton compiler parameters for a `pallas_call`."""
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def tpu_compiler_params(*, dimension_semantics: tuple[str, ...]) -> pltpu.CompilerParams:
  """Mosaic TPU compiler parameters for a `pallas_call`."""
  return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


__all__ = [
  "MOSAIC_CUSTOM_CALL",
  "TRITON_CUSTOM_CALL",
  "pl",
  "plgpu",
  "pltpu",
  "tpu_compiler_params",
  "triton_compiler_params",
]
