"""Print the Tunix matrix of docs/ecosystem.md: every model and dtype through every flow.

    python scripts/ecosystem_table.py [llama3-float32 ...]

Needs `.[ecosystem]` and google-tunix (docs/ecosystem.md). The numbers are what
tests/ecosystem/test_tunix.py holds to its targets (the same checks, `tunix_checks.py`); the
sharded column is tests/ecosystem/test_tunix_sharded.py's (it needs 4 devices).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._utils import rel_err  # noqa: E402
from tests.ecosystem import tunix_checks as tc  # noqa: E402
from tests.ecosystem import tunix_models as tm  # noqa: E402

HEAD = (
  "| model | dtype | err Q8_0 (tables Q8_0) | err Q8_0 (tables float) | err Qwix int8 |"
  " jit vs eager (float model's own) | params unchanged | quantize_params = init |"
  " QAT vs served: eager (jit) | QAT grads: finite, cos to float |"
)


def row(case: tm.Case) -> str:
  s = tc.serve(case)
  int8 = tc.qwix_int8_error(s)
  before = tc.state_bytes(s.q8)
  jit_vs_eager = rel_err(s.jitted, s.eager)
  unchanged = tc.state_bytes(s.q8) == before
  f32 = case.dtype == "float32"
  q = tc.qat(s, with_grads=f32)
  cells = [
    case.name,
    case.dtype,
    f"{tc.error(s.eager, s):.2e}",
    f"{tc.tables_float_error(s):.2e}",
    "fails (F2)" if int8 is None else f"{int8:.2e}",
    f"{jit_vs_eager:.1e} ({tc.float_jit_vs_eager(s):.1e})",
    "yes" if unchanged else "NO",
    "bit-equal" if tc.quantize_params_bit_equal(s) else "DIFFERS",
    f"{q.eager_vs_served:.1e} ({q.jit_vs_served:.1e})",
    f"{'yes' if q.grads_finite else 'NO'}, {q.grad_cosine_to_float:.4f}" if f32 else "-",
  ]
  return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> None:
  warnings.simplefilter("ignore")
  cases = [c for c in tm.CASES if not argv or c.id in argv or c.name in argv]
  print(HEAD)
  print("|" + "---|" * HEAD.count(" |"))
  with tc.tunix_flags():
    for case in cases:
      print(row(case), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
