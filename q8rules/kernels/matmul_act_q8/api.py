"""The Q8_0 x Q8_0 product, op 'matmul_act_q8': activations quantized to Q8_0 too, opt-in.

llama.cpp multiplies a Q8_0 weight by activations it first quantizes to Q8_0 blocks of 32
along K, with integer block dots (VNNI's `vpdpbusd` on x86). This is that product, chosen by
`Q8Rule(act_qtype="q8_0")` (Qwix's field for activation quantization) or
`q8_matmul(..., act_qtype="q8_0")`. The weight-only product (`act_qtype=None`, the default)
is float32-accurate; this one is not: each activation is rounded to one of 255 levels of its
block's absmax (relative error about 0.4 % of ‖x‖ per block), as in llama.cpp.

Numerics (`reference`), the same in every implementation to float32 rounding: gguf.quants'
quantizer on the activations, exact block dots, each folded in with its two scales' product,
accumulated in float32 (`reference.reference_float64` is the float64 reference the tests hold
every implementation to, within 1e-6). Derivatives are the weight-only product's (a
straight-through estimator on the activations' rounding).

Implementations, chosen by `kernels.registry.resolve` like every op's: 'cpu' (`cpu.py`, the
native library) and 'xla' (`xla.py`, every backend). Each runs `run(x2d, q, scale, layer=None)`
-> (m, N) float32.
"""

from __future__ import annotations

from q8rules.kernels import registry
from q8rules.kernels.matmul_act_q8 import cpu, xla
from q8rules.kernels.matmul_act_q8.reference import (
  quantize_activations,
  reference_float64,
  round_trip,
)

ACT_QTYPES = ("q8_0",)
"""The activation qtypes a product may take (None: weight-only, activations stay float)."""

DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
  "cpu": ("cpu", "xla"),
  "gpu": ("xla",),
  "tpu": ("xla",),
}
"""What `implementation=None` tries, per platform; the last always runs."""

OP = registry.register(registry.Op.of("matmul_act_q8", (cpu, xla), DEFAULT_ORDER, fallback="xla"))
"""The op: its implementations and default order."""

IMPLEMENTATIONS = OP.names
"""The implementations of the Q8_0 x Q8_0 product."""


def check_act_qtype(act_qtype: object) -> None:
  """Raise a clear error unless `act_qtype` is None or one of `ACT_QTYPES`."""
  if act_qtype is not None and act_qtype not in ACT_QTYPES:
    raise ValueError(f"act_qtype={act_qtype!r}: expected None (weight-only) or one of {ACT_QTYPES}")


__all__ = [
  "ACT_QTYPES",
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "OP",
  "check_act_qtype",
  "quantize_activations",
  "reference_float64",
  "round_trip",
]
