"""'pallas': the grouped product's Pallas kernels, `pallas_mosaic_tpu` on TPU and
`pallas_triton` on GPU; on CPU the TPU form runs in Pallas interpret mode (tests only).

Both read only the routed experts' int8 values and scales (the work items of
`groups.work_items`: empty groups have none) and accumulate in float32.
"""

from __future__ import annotations

import jax

from q8rules.kernels.matmul import pallas_triton as fold_triton
from q8rules.kernels.ragged_matmul import pallas_mosaic_tpu, pallas_triton
from q8rules.kernels.ragged_matmul.problem import RaggedProblem

NAME = "pallas"
SUMMARY = "Pallas kernels over (expert, row tile) items (Mosaic TPU, Triton GPU; interpret on CPU)"

FORM_OF = {"tpu": "tpu", "cpu": "tpu", "gpu": "gpu"}
"""The kernel form each platform runs (the CPU interprets the TPU form)."""


def cannot(p: RaggedProblem) -> str | None:
  """Why the kernels cannot run `p`: a GPU older than Pallas Triton needs (None: they can)."""
  if p.platform == "gpu":
    return fold_triton.device_reason()
  return None


def slower(p: RaggedProblem) -> str | None:
  """On CPU the kernels only interpret: `implementation=None` passes them over there."""
  if p.platform == "cpu":
    return "on CPU the Pallas kernels run only in interpret mode"
  return None


def ragged_pallas(
  x2d: jax.Array,
  q: jax.Array,
  scale: jax.Array,
  group_sizes: jax.Array,
  *,
  form: str = "tpu",
  interpret: bool = False,
) -> jax.Array:
  """`out[m] = x2d[m] @ (q[g(m)] * scale[g(m)])` with the `form` ('tpu' or 'gpu') kernel: x2d
  (M, K) float32/bfloat16/float16, q (E, K, N) int8, scale (E, K/32, N), group_sizes (E,) int32
  -> (M, N) float32."""
  if form == "tpu":
    return pallas_mosaic_tpu.ragged_tpu(x2d, q, scale, group_sizes, interpret=interpret)
  if form == "gpu":
    return pallas_triton.ragged_gpu(x2d, q, scale, group_sizes, interpret=interpret)
  raise ValueError(f"ragged_pallas: form={form!r}; expected 'tpu' or 'gpu'")


def run(x2d, q, scale, group_sizes, platform: str, interpret: bool | None) -> jax.Array:
  """The registry's call: the kernel of `platform`'s form; `interpret` None: on CPU only."""
  interpret = platform == "cpu" if interpret is None else interpret
  return ragged_pallas(x2d, q, scale, group_sizes, form=FORM_OF[platform], interpret=interpret)


__all__ = ["FORM_OF", "NAME", "SUMMARY", "cannot", "ragged_pallas", "run", "slower"]
