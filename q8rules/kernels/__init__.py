"""One product, several implementations, one switch: `q8_matmul(x, w, implementation=None)`.

The registry and the only function that picks an implementation (`resolve`) are
in `api.py`; what a product is (its operand check, its `Problem`, the platforms) in
`problem.py`; each implementation is a module named for what it is, with its own
`cannot`, `slower` and `run`: `fold.py` (over `pallas_mosaic_tpu.py` and
`pallas_triton.py`, the fold's two forms), `cpu_native.py` (+ `cpu/q8_gemv.cc`),
`xla_chunked.py`, `xla_dequant.py`, `reference.py`. With `act_qtype='q8_0'` (opt-in) the
activations are quantized too: `act_q8_0.py` (implementations 'cpu' and 'xla').
"""

from q8rules.kernels.api import (
  ACT_DEFAULT_ORDER,
  CPU_MAX_ROWS,
  DEFAULT_ORDER,
  IMPLEMENTATIONS,
  REGISTRY,
  Implementation,
  ImplementationArg,
  check_implementation,
  check_operands,
  platform_of,
  q8_matmul,
  resolve,
  run_product,
  why_not,
)
from q8rules.kernels.export import CUSTOM_CALL_TARGETS, export_checks, lowering_context
from q8rules.kernels.fold import fold_applies, q8_fold

__all__ = [
  "ACT_DEFAULT_ORDER",
  "CPU_MAX_ROWS",
  "CUSTOM_CALL_TARGETS",
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "REGISTRY",
  "Implementation",
  "ImplementationArg",
  "check_implementation",
  "check_operands",
  "export_checks",
  "fold_applies",
  "lowering_context",
  "platform_of",
  "q8_fold",
  "q8_matmul",
  "resolve",
  "run_product",
  "why_not",
]
