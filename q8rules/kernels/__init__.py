"""The kernels: every op, its implementations, and one switch, `resolve`.

Each op is a folder, tokamax's way: `api.py` (the entry point and the op's registration), a
reference implementation, and one module per implementation.

  matmul/            the weight-only Q8_0 product: `q8_matmul(x, w, implementation=None)`;
                     'fold' (Pallas: Mosaic TPU, Triton GPU), 'cpu' (native), 'xla',
                     'xla_dequant', 'reference'
  matmul_act_q8/     the Q8_0 x Q8_0 product (`act_qtype='q8_0'`): 'cpu', 'xla'
  matmul_t/          the transposed product dy @ W^T (the gradient in x): `q8_matmul_t(dy, w)`;
                     'cpu' (native), 'xla', 'reference'
  decode_attention/  one new token's attention over a KV cache layer: 'cpu', 'xla'
  ragged_matmul/     the grouped Q8_0 product of experts (`jax.lax.ragged_dot`'s contract):
                     `q8_ragged_matmul(x, w, group_sizes)`; 'pallas' (Mosaic TPU, Triton GPU),
                     'cpu' (native), 'xla', 'reference'
  native/            the native CPU library, one C++ source per op

`registry.py` holds what an op and an implementation are and `resolve(op, problem,
implementation=None)`, the only function that picks, for every op, at trace time and again per
platform when a program is lowered. `problem.py` says what a product is (its operand check, its
`Problem`, the platforms); `layer.py` a product on one layer of stacked weights.
"""

from q8rules.kernels.decode_attention import api as decode_attention_api
from q8rules.kernels.export import CUSTOM_CALL_TARGETS, export_checks, lowering_context
from q8rules.kernels.matmul.api import (
  DEFAULT_ORDER,
  IMPLEMENTATIONS,
  REGISTRY,
  check_implementation,
  q8_matmul,
  resolve_product,
  run_product,
  why_not,
)
from q8rules.kernels.matmul.cpu import CPU_MAX_ROWS
from q8rules.kernels.matmul.fold import fold_applies, q8_fold
from q8rules.kernels.matmul_act_q8 import api as matmul_act_q8_api
from q8rules.kernels.matmul_t.api import q8_matmul_t
from q8rules.kernels.problem import check_operands, platform_of
from q8rules.kernels.ragged_matmul.api import IMPLEMENTATIONS as RAGGED_IMPLEMENTATIONS
from q8rules.kernels.ragged_matmul.api import q8_ragged_matmul, run_ragged
from q8rules.kernels.registry import OPS, Implementation, ImplementationArg, Op, resolve

ACT_DEFAULT_ORDER = matmul_act_q8_api.DEFAULT_ORDER
"""What `implementation=None` tries for the Q8_0 x Q8_0 product, per platform."""

del decode_attention_api

__all__ = [
  "ACT_DEFAULT_ORDER",
  "CPU_MAX_ROWS",
  "CUSTOM_CALL_TARGETS",
  "DEFAULT_ORDER",
  "IMPLEMENTATIONS",
  "OPS",
  "REGISTRY",
  "Implementation",
  "ImplementationArg",
  "Op",
  "check_implementation",
  "check_operands",
  "export_checks",
  "fold_applies",
  "lowering_context",
  "platform_of",
  "q8_fold",
  "q8_matmul",
  "q8_matmul_t",
  "RAGGED_IMPLEMENTATIONS",
  "q8_ragged_matmul",
  "run_ragged",
  "resolve",
  "resolve_product",
  "run_product",
  "why_not",
]
