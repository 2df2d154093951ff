"""The one switch: every op's implementations, and `resolve`, the only function that picks one.

An op (`Op`) is a named computation with several implementations (tokamax's model: a
reference beside each kernel, one module per implementation, `implementation=` to choose).
Each implementation says where it cannot run a problem (`cannot`) and where
`implementation=None` passes it over for a faster one (`slower`); the op lists, per platform,
the order `implementation=None` tries them in, the last of which always runs. A problem is
the op's own frozen dataclass with at least a `platform` ('cpu', 'gpu' or 'tpu') and a
`describe()` for messages.

The ops register themselves when their package is imported (`q8rules.kernels` imports them
all): 'matmul' (the weight-only Q8_0 product, `kernels/matmul/`), 'matmul_act_q8' (the
Q8_0 x Q8_0 product, `kernels/matmul_act_q8/`) and 'decode_attention' (one new token's
attention over a KV cache layer, `kernels/decode_attention/`). Each op's entry point calls
`resolve` again when its program is lowered, per platform, so one `jax.export` artifact runs
the right kernel on CPU, GPU and TPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import jax

ImplementationArg = str | Sequence[str] | None
"""`implementation=`: None (the best for the platform and problem), a name, or names tried in
order."""


class Problem(Protocol):
  """What an op's implementations judge: an op's own frozen dataclass."""

  platform: str

  def describe(self) -> str:
    """The problem as a message names it, e.g. '(1, 4096) x (4096, 4096)'."""
    ...


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to run an op: an implementation module's `NAME`, `SUMMARY`, `cannot`, `slower` and
  `run` (and, for the products, `ROUNDS_WEIGHT`).

  Attributes:
    name: what `implementation=` calls it.
    summary: one line for docs and errors.
    cannot: why it cannot run a problem (None: it can).
    slower: why `implementation=None` passes it over for the next one (None: pick it).
    run: the computation on checked operands; its signature is the op's.
    rounds_weight: (products) True when bf16/f16 activations meet the weight rounded to their
      dtype; False when every product is exact and only float32 accumulation rounds.
    run_layer: (products) the computation on one layer of stacked weights read in place, for
      an implementation that can (None: the layer is sliced out first, `LayerSlice.take`).
  """

  name: str
  summary: str
  cannot: Callable[[Any], str | None]
  slower: Callable[[Any], str | None]
  run: Callable[..., Any]
  rounds_weight: bool = False
  run_layer: Callable[..., Any] | None = None

  @classmethod
  def of(cls, module: ModuleType) -> Implementation:
    """The implementation an implementation module defines (`ROUNDS_WEIGHT` and `run_layer`
    are optional)."""
    optional = vars(module)
    return cls(
      module.NAME,
      module.SUMMARY,
      module.cannot,
      module.slower,
      module.run,
      optional.get("ROUNDS_WEIGHT", False),
      optional.get("run_layer"),
    )


@dataclasses.dataclass(frozen=True)
class Op:
  """A computation with several implementations.

  Attributes:
    name: the op's name ('matmul', 'matmul_act_q8', 'decode_attention').
    implementations: name -> `Implementation`, in the order docs list them.
    default_order: per platform ('cpu', 'gpu', 'tpu'), what `implementation=None` tries, in
      order; the last always runs.
    fallback: the implementation a refusal's message suggests (one that runs every problem).
  """

  name: str
  implementations: Mapping[str, Implementation]
  default_order: Mapping[str, tuple[str, ...]]
  fallback: str

  @classmethod
  def of(
    cls,
    name: str,
    modules: Sequence[ModuleType],
    default_order: Mapping[str, tuple[str, ...]],
    fallback: str,
  ) -> Op:
    """The op whose implementations are `modules` (each with `NAME`, `SUMMARY`, `cannot`,
    `slower`, `run`)."""
    implementations = {m.NAME: Implementation.of(m) for m in modules}
    for platform, order in default_order.items():
      unknown = [n for n in order if n not in implementations]
      if unknown:
        raise ValueError(f"op {name!r}: {platform} order names unknown {unknown}")
    return cls(name, implementations, dict(default_order), fallback)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.implementations)


OPS: dict[str, Op] = {}
"""Every registered op, by name."""


def register(op: Op) -> Op:
  """Add `op` to `OPS` (once per name) and return it."""
  if OPS.get(op.name, op) is not op:
    raise ValueError(f"op {op.name!r} is registered already")
  OPS[op.name] = op
  return op


def op_of(op: str | Op) -> Op:
  """The registered op named `op` (or `op` itself)."""
  if isinstance(op, Op):
    return op
  if op not in OPS:
    raise ValueError(f"unknown op {op!r}; expected one of {tuple(OPS)}")
  return OPS[op]


def implementation_names(implementation: ImplementationArg) -> tuple[str, ...]:
  """The names `implementation` (a name or a sequence of them) tries, in order."""
  if isinstance(implementation, str):
    return (implementation,)
  return tuple(implementation or ())


def check_implementation(
  implementation: ImplementationArg, op: str | Op = "matmul", *, what: str = "implementation"
) -> None:
  """Raise a clear error unless `implementation` is None, one of `op`'s names, or a sequence
  of them."""
  if implementation is None:
    return
  o = op_of(op)
  names = implementation
  if isinstance(names, str):
    names = (names,)
  if isinstance(names, Sequence) and names and all(isinstance(n, str) for n in names):
    if all(n in o.implementations for n in names):
      return
  raise ValueError(
    f"{what}={implementation!r}: expected None, one of {o.names} (op {o.name!r}'s"
    " implementations), or a sequence of them"
  )


def why_not(op: str | Op, name: str, problem: Problem) -> str | None:
  """Why implementation `name` of `op` cannot run `problem` (None: it can)."""
  o = op_of(op)
  check_implementation(name, o)
  return o.implementations[name].cannot(problem)


def jit_impl(primitive: Any) -> Callable[..., Any]:
  """An eager `def_impl` for a primitive lowered per platform: the primitive alone, compiled
  once per parameters and operand shapes (`jax.jit` of its bind, which lowers it as a program
  would), as JAX runs its own primitives eagerly. Run op by op instead, an implementation's
  `lax.scan` is traced and compiled again at every eager call."""

  @functools.cache
  def compiled(items: tuple) -> Callable[..., Any]:
    params = dict(items)
    return jax.jit(lambda *args: primitive.bind(*args, **params))

  def impl(*args: Any, **params: Any) -> Any:
    return compiled(tuple(sorted(params.items())))(*args)

  return impl


def resolve(op: str | Op, problem: Problem, implementation: ImplementationArg = None) -> str:
  """The implementation of `op` that runs `problem`: the one choice for every op.

  Args:
    op: an op's name (`OPS`) or the `Op`.
    problem: the op's problem, on its platform (`problem.platform`).
    implementation: None (the first of `op.default_order[platform]` that can run the problem
      and is not slower than the next; else the last), a name (it must be able to run the
      problem), or a sequence of names (the first that can).

  Raises:
    ValueError: an unknown name, or no named implementation can run the problem; the message
      gives each one's reason.
  """
  o = op_of(op)
  check_implementation(implementation, o)
  if implementation is None:
    order = o.default_order[problem.platform]
    for name in order:
      impl = o.implementations[name]
      if impl.cannot(problem) is None and impl.slower(problem) is None:
        return name
    return order[-1]
  reasons = []
  for name in implementation_names(implementation):
    reason = o.implementations[name].cannot(problem)
    if reason is None:
      return name
    reasons.append(f"{name!r}: {reason}")
  raise ValueError(
    f"implementation={implementation!r} cannot run {o.name} {problem.describe()} on"
    f" {problem.platform}: {'; '.join(reasons)}; use {o.fallback!r}, which runs every shape"
  )


__all__ = [
  "OPS",
  "Implementation",
  "ImplementationArg",
  "Op",
  "Problem",
  "check_implementation",
  "implementation_names",
  "jit_impl",
  "op_of",
  "register",
  "resolve",
  "why_not",
]
