"""What `jax.export` needs to be told to carry q8rules' kernels.

JAX refuses to export a custom call that is not on its list of targets with a
compatibility guarantee. q8rules' kernels are such calls: the native CPU kernel
(an XLA FFI target registered by this package), the Triton fold on GPU and the
Mosaic fold on TPU. An exported served model therefore needs

    jax.export.export(f, platforms=("cpu", "cuda", "tpu"),
                      disabled_checks=q8rules.export_checks())

and, where it is deserialized and run, the same q8rules version (the kernels'
custom-call contracts are this package's, not JAX's). Exporting for 'cuda' from a
host without a GPU needs `lowering_context(platforms)` around the export on jax >= 0.11.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
from jax import export as jax_export

from q8rules.kernels.matmul._pallas_compat import MOSAIC_CUSTOM_CALL, TRITON_CUSTOM_CALL
from q8rules.kernels.native.library import TARGET as CPU_CUSTOM_CALL
from q8rules.kernels.native.library import (
  TARGET_ACT_Q8,
  TARGET_ACT_Q8_LAYER,
  TARGET_DECODE_ATTENTION,
  TARGET_LAYER,
  TARGET_MATMUL_T,
  TARGET_RAGGED,
)

CUSTOM_CALL_TARGETS = (
  CPU_CUSTOM_CALL,
  TARGET_LAYER,
  TARGET_ACT_Q8,
  TARGET_ACT_Q8_LAYER,
  TARGET_MATMUL_T,
  TARGET_DECODE_ATTENTION,
  TARGET_RAGGED,
  TRITON_CUSTOM_CALL,
  MOSAIC_CUSTOM_CALL,
)
"""The custom-call targets q8rules' kernels lower to: native CPU (the product, on a stacked
layer in place, and both with Q8_0 activations; the transposed product, the gradient with
respect to x; one decode token's attention; the grouped product of experts), Triton (GPU),
Mosaic (TPU)."""


def export_checks() -> list[jax_export.DisabledSafetyCheck]:
  """The `disabled_checks` for `jax.export.export` of a program that runs q8rules' kernels."""
  return [jax_export.DisabledSafetyCheck.custom_call(t) for t in CUSTOM_CALL_TARGETS]


def lowering_context(platforms: Sequence[str]) -> contextlib.AbstractContextManager:
  """The context an export for `platforms` needs on a host without their devices.

  jax >= 0.11 lowers a Triton kernel only for a known GPU: with none attached, an
  abstract one (an H200; the Triton fold's code does not depend on the model of
  GPU) is named through an abstract mesh. Elsewhere (jax 0.10, or a GPU attached,
  or no 'cuda' among `platforms`) nothing is needed.
  """
  abstract_device = getattr(jax.sharding, "AbstractDevice", None)
  if "cuda" not in platforms or abstract_device is None or jax.default_backend() == "gpu":
    return contextlib.nullcontext()
  device = abstract_device(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


__all__ = ["CUSTOM_CALL_TARGETS", "export_checks", "lowering_context"]
