"""`Q8Rule`: a `qwix.QuantizationRule` that says "serve this op's weight as Q8_0"."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from q8rules._qwix import QuantizationRule
from q8rules.kernels import ImplementationArg, check_implementation
from q8rules.kernels.matmul_act_q8 import api as act_q8_0

Q8_0 = "q8_0"
"""The `weight_qtype` every Q8Rule carries."""

KEEP_FLOAT: tuple[tuple[str, str], ...] = (
  (r"(^|/)(router\w*|\w*gate_inp\w*)(/|$)", "a router (llama.cpp's ffn_gate_inp)"),
  (r"per_layer_model_proj", "Gemma's per-layer model projection (per_layer_model_proj)"),
  (r"altup", "Gemma's altup"),
  (r"laurel", "Gemma's laurel"),
)
"""What `Q8Rule(keep_float=None)` leaves float, as llama.cpp's quantizer (`src/llama-quant.cpp`)
leaves these tensors float: (regex searched in the weight's param path, what it is). A router
is a module or param named `router...` (Tunix's, MaxText's) or `...gate_inp...` (GGUF's); a
router named plainly `gate` (Hugging Face's Mixtral) is not told from a dense MLP's gate by its
name: keep it float with `keep_float=(r"block_sparse_moe/gate",)`. Norms and biases are one
axis, never served."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Q8Rule(QuantizationRule):
  """Match ops by `module_path` (a regex on the Flax module path) and `op_names`
  (`'dot_general'`, which also covers `jnp.dot` and `jnp.matmul`, and `'einsum'`), as
  `qwix.QuantizationRule` does, and quantize their weight to Q8_0 (weight-only by default:
  activations stay float).

  Attributes:
    act_qtype: None (weight-only, float32-accurate products), or 'q8_0': the activations are
      quantized to Q8_0 blocks along K at run time too, as llama.cpp quantizes them, and the
      product runs on int8 block dots (`q8rules.kernels.matmul_act_q8`; implementations 'cpu' and
      'xla'). Opt-in: each activation block is rounded to 255 levels of its absmax.
    scale_dtype: float32 (default, as on the chip) or float16 (GGUF's).
    implementation: None picks the best for the backend and shape; a name of
      `q8rules.kernels.IMPLEMENTATIONS` ('fold', 'cpu', 'xla', 'xla_dequant', 'reference') or a
      sequence of them tried in order (see `q8rules.kernels.resolve`).
    interpret: run the fold in Pallas interpret mode (None: on CPU only).
    keep_float: regexes searched in a matched weight's param path ('layers_0/moe/router/kernel')
      that leave its products float; None: llama.cpp's list (`KEEP_FLOAT`: routers, Gemma's
      per-layer model projection, altup, laurel); (): serve every matched weight.
  """

  weight_qtype: Any = Q8_0
  scale_dtype: Any = jnp.float32
  implementation: ImplementationArg = None
  interpret: bool | None = None
  keep_float: tuple[str, ...] | None = None

  def __post_init__(self) -> None:
    """Refuse, at construction, options Q8_0 cannot honour (the reason first, then the rule)."""
    problems = rule_problems(self)
    if problems:
      raise ValueError(f"Q8Rule cannot honour {'; '.join(problems)}; in {self!r}")


def describe(rule: QuantizationRule) -> str:
  """The rule with only its non-default fields, e.g. `Q8Rule(module_path='mlp/.*')`."""

  def is_default(f: dataclasses.Field) -> bool:
    if f.default is not dataclasses.MISSING:
      return getattr(rule, f.name) == f.default
    if f.default_factory is not dataclasses.MISSING:
      return getattr(rule, f.name) == f.default_factory()
    return False  # a required field (a LoRA rule's rank): always shown

  fields = [
    f"{f.name}={getattr(rule, f.name)!r}"
    for f in dataclasses.fields(rule)
    if not is_default(f) and f.name not in ("act_static_scale", "act_calibration_method")
  ]
  return f"{type(rule).__name__}({', '.join(fields)})"


def rule_problems(rule: QuantizationRule) -> list[str]:
  """Why each option of `rule` cannot be honoured by Q8_0 serving (empty when all can)."""
  problems = []
  if rule.weight_qtype != Q8_0:
    problems.append(f"weight_qtype={rule.weight_qtype!r} (Q8_0 only)")
  if rule.act_qtype is not None and rule.act_qtype not in act_q8_0.ACT_QTYPES:
    problems.append(
      f"act_qtype={rule.act_qtype!r} (None, weight-only, or {Q8_0!r}: Q8_0 activations)"
    )
  if rule.act_static_scale:
    problems.append("act_static_scale (Q8_0 activations take their scales from each block)")
  if rule.act_qtype is not None and rule.act_calibration_method not in (None, "absmax"):
    problems.append(
      f"act_calibration_method={rule.act_calibration_method!r} (Q8_0 activations are absmax)"
    )
  if rule.tile_size is not None:
    problems.append(f"tile_size={rule.tile_size!r} (Q8_0 blocks are always 32 rows)")
  if rule.weight_calibration_method != "absmax":
    problems.append(
      f"weight_calibration_method={rule.weight_calibration_method!r} (Q8_0 is absmax)"
    )
  try:
    scale_dtype = np.dtype(getattr(rule, "scale_dtype", np.float32))
  except TypeError:
    scale_dtype = None
  if scale_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
    problems.append(f"scale_dtype={rule.scale_dtype!r} (float32 or float16)")
  keep = getattr(rule, "keep_float", None)
  if keep is not None:
    if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
      problems.append(f"keep_float={keep!r} (None, or a tuple of regexes)")
    else:
      for k in keep:
        try:
          re.compile(k)
        except re.error as e:
          problems.append(f"keep_float regex {k!r} ({e})")
  implementation = getattr(rule, "implementation", None)
  try:
    check_implementation(implementation)
  except ValueError as e:
    problems.append(str(e))
  else:
    if rule.act_qtype in act_q8_0.ACT_QTYPES and implementation is not None:
      names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
      off = [n for n in names if n not in act_q8_0.IMPLEMENTATIONS]
      if off:
        problems.append(
          f"implementation={implementation!r} with act_qtype={rule.act_qtype!r}"
          f" (the Q8_0 x Q8_0 product runs on {' or '.join(map(repr, act_q8_0.IMPLEMENTATIONS))},"
          f" not on {', '.join(map(repr, off))})"
        )
  return problems


KEPT = "kept float"
"""How the reason for a weight a rule keeps float begins (`kept_float`)."""


def kept_float(rule: Q8Rule, path: str) -> str | None:
  """Why `rule` leaves the weight at param path `path` float (its `keep_float`), or None."""
  if rule.keep_float is None:
    for pattern, what in KEEP_FLOAT:
      if re.search(pattern, path):
        return (
          f"kept float: {what}, as llama.cpp's quantizer keeps it (Q8Rule(keep_float=()) serves it)"
        )
    return None
  for pattern in rule.keep_float:
    if re.search(pattern, path):
      return f"{KEPT}: the rule's keep_float {pattern!r}"
  return None


def validate_rule(rule: QuantizationRule, *, provider: str) -> Q8Rule:
  """Raise a clear error on a rule the Q8_0 providers cannot honour (the reason first).

  A `Q8Rule` is checked at construction already; this catches one built around
  its `__post_init__` (e.g. `object.__setattr__`) and rules of other types.
  """
  if not isinstance(rule, Q8Rule):
    raise TypeError(f"{provider} takes q8rules.Q8Rule, got {type(rule).__name__}: {rule}")
  problems = rule_problems(rule)
  if problems:
    raise ValueError(f"{provider} cannot honour {'; '.join(problems)}; in rule {rule}")
  return rule


def q8_rule(q8_paths: list[tuple[str, ...]], act_qtype: str | None = None) -> Q8Rule:
  """One rule matching exactly the modules that own the params at `q8_paths` (the module
  path is the param path minus its leaf), with GGUF's float16 scales; `act_qtype` the
  rule's (None: weight-only; 'q8_0': Q8_0 activations too). The rule of a model loaded from
  a GGUF file (its Q8_0 tensors' params) and of one rebuilt from it."""
  alternatives = "|".join(sorted({re.escape("/".join(p[:-1])) for p in q8_paths}))
  return Q8Rule(module_path=f"(?:{alternatives})", scale_dtype=jnp.float16, act_qtype=act_qtype)
