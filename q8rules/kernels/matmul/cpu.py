"""'cpu': the weight-only product on the native CPU library (`kernels/native/`)."""

from __future__ import annotations

from q8rules.kernels.cpu_native import (
  CPU_MAX_ROWS,
  NAME,
  ROUNDS_WEIGHT,
  SUMMARY,
  cannot,
  q8_matmul_cpu,
  q8_matmul_cpu_layer,
  run,
  slower,
)

run_layer = q8_matmul_cpu_layer

__all__ = [
  "CPU_MAX_ROWS",
  "NAME",
  "ROUNDS_WEIGHT",
  "SUMMARY",
  "cannot",
  "q8_matmul_cpu",
  "run",
  "run_layer",
  "slower",
]
