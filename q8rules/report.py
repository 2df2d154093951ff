"""What a provider did to each op: module path, op, rule, path taken, bytes."""

from __future__ import annotations

import dataclasses

from q8rules.rules import describe


@dataclasses.dataclass
class OpRecord:
  """One intercepted op.

  Attributes:
    module: the Flax module path ('' for the top module).
    op: the op and its index within the module, e.g. 'dot_general0'.
    rule: index of the matched rule, or None.
    path: the implementation that ran (`q8rules.kernels.resolve`: 'fold', 'cpu',
      'xla', 'xla_dequant', 'reference'; per shard under a mesh; 'cpu (act q8_0)' and the like
      where the rule quantizes activations too), 'fake_quant' (QAT), or 'float' (left
      untouched).
    weight_shape: the float weight's shape (None when the op has no weight).
    m, k, n: the product as (M, K) @ (K, N) (K before padding).
    float_bytes: bytes the weight takes as float (its own dtype).
    q8_bytes: bytes it takes as Q8_0 (int8 values + scales), 0 when float.
    note: why an op stayed float, or that K was padded.
  """

  module: str
  op: str
  rule: int | None
  path: str
  weight_shape: tuple[int, ...] | None = None
  m: int = 0
  k: int = 0
  n: int = 0
  float_bytes: int = 0
  q8_bytes: int = 0
  note: str = ""


@dataclasses.dataclass(frozen=True)
class FloatParam:
  """A param of two or more axes, under a module a rule matched, that was not served as Q8_0.

  Attributes:
    path: the param's path ('layers_0/mlp/router/kernel').
    shape: its float shape.
    reason: why it stays float (kept float as llama.cpp's quantizer keeps it, an op that is not
      served, only used outside a product, ...).
  """

  path: str
  shape: tuple[int, ...]
  reason: str


@dataclasses.dataclass
class Report:
  """Every intercepted op of a model, the rules that matched nothing, and every param of two
  or more axes under a matched module that stayed float (`float_params`), with why."""

  ops: list[OpRecord]
  unused_rules: list
  float_params: list[FloatParam] = dataclasses.field(default_factory=list)

  @property
  def float_bytes(self) -> int:
    return sum(r.float_bytes for r in self.ops if r.q8_bytes)

  @property
  def q8_bytes(self) -> int:
    return sum(r.q8_bytes for r in self.ops)

  def paths(self) -> dict[str, str]:
    """'module/op' -> path taken."""
    return {f"{r.module}/{r.op}": r.path for r in self.ops}

  def __str__(self) -> str:
    head = ("module", "op", "rule", "path", "weight", "M x K x N", "float B", "Q8 B", "note")
    rows = [
      (
        r.module or "(top)",
        r.op,
        "-" if r.rule is None else str(r.rule),
        r.path,
        "x".join(map(str, r.weight_shape)) if r.weight_shape else "-",
        f"{r.m}x{r.k}x{r.n}" if r.k else "-",
        f"{r.float_bytes:,}" if r.float_bytes else "-",
        f"{r.q8_bytes:,}" if r.q8_bytes else "-",
        r.note,
      )
      for r in self.ops
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]
    lines = [
      "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
      for row in (head, *rows)
    ]
    if self.q8_bytes:
      lines.append(
        f"quantized weights: {self.float_bytes:,} B as float -> {self.q8_bytes:,} B as Q8_0"
        f" ({self.q8_bytes / self.float_bytes:.3f}x)"
      )
    for rule in self.unused_rules:
      lines.append(f"rule matched nothing: {describe(rule)}")
    for p in self.float_params:
      lines.append(f"left float: {p.path} {'x'.join(map(str, p.shape))}: {p.reason}")
    return "\n".join(lines)
