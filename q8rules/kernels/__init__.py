"""One product, several implementations, one switch: `q8_matmul(x, w, implementation=None)`.

The registry and the only function that picks an implementation (`resolve`) are
in `api.py`; each implementation is a file named for what it is:
`pallas_mosaic_tpu.py` and `pallas_triton.py` (the fold's two forms, wrapped by
`fold.py`), `cpu_native.py` (+ `cpu/q8_gemv.cc`), `xla_chunked.py`, `xla_dequant.py`,
`reference.py`.
"""

from q8rules.kernels.api import (
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
from q8rules.kernels.export import CUSTOM_CALL_TARGETS, export_checks
from q8rules.kernels.fold import fold_applies, fold_reason, q8_fold

__all__ = [
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
  "fold_reason",
  "platform_of",
  "q8_fold",
  "q8_matmul",
  "resolve",
  "run_product",
  "why_not",
]
