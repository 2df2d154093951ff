"""The Pallas names the fold kernels use, imported from one place.

The TPU (Mosaic) names have been stable since jax 0.7: `pl`, `pltpu.VMEM`,
`pltpu.CompilerParams`. The Triton ones moved more:

  jax <= 0.6.0   `jax.experimental.pallas.gpu` (removed in 0.6.1)
  jax >= 0.4.34  `jax.experimental.pallas.triton`; its `CompilerParams` was
                 `TritonCompilerParams` before jax 0.7
  jax 0.11       `pallas.triton` still there, deprecated in favour of Mosaic
                 GPU (it may warn on import; the warning is silenced here)

Kernels index refs (`ref[pl.ds(i, n), :]`) rather than call `pl.load`, which
jax 0.7 deprecated.
"""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  try:
    from jax.experimental.pallas import triton as plgpu
  except ImportError:  # jax < 0.4.34
    from jax.experimental.pallas import gpu as plgpu  # type: ignore[no-redef]

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
"""The custom call a Pallas Triton kernel lowers to (checked by the lowering tests)."""

MOSAIC_CUSTOM_CALL = "tpu_custom_call"
"""The custom call a Pallas Mosaic TPU kernel lowers to."""


def triton_compiler_params(*, num_warps: int, num_stages: int):
  """`plgpu.CompilerParams(num_warps=..., num_stages=...)` under its name in this jax."""
  cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
  return cls(num_warps=num_warps, num_stages=num_stages)


def tpu_compiler_params(*, dimension_semantics: tuple[str, ...]):
  """`pltpu.CompilerParams(dimension_semantics=...)` under its name in this jax."""
  cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
  return cls(dimension_semantics=dimension_semantics)


__all__ = [
  "MOSAIC_CUSTOM_CALL",
  "TRITON_CUSTOM_CALL",
  "pl",
  "plgpu",
  "pltpu",
  "tpu_compiler_params",
  "triton_compiler_params",
]
