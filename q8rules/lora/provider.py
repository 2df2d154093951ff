"""`Q8LoraProvider`: LoRA adapters on a frozen Q8_0 base, as `qwix.LoraProvider` on Qwix's own.

A product matched by a `Q8LoraRule` is served as `Q8Provider` serves it (the Q8_0 param, int8
values and one scale per 32-row block, through the same kernels, no float copy of the weight)
and gets the adapter's delta added:

    y = served(x, W_q8) + dropout(x) @ A @ B * alpha / rank

with A (K, rank) and B (rank, N) float32 params along the weight's own K (contracted) and N
(kept) axes, whatever the op (`lax.dot_general`, `jnp.einsum` of two operands, a tied head
through `embedding.T`). A stack of experts (E, K, N) gets one adapter per expert, as PEFT and
Unsloth give MoE experts: A (E, K, rank), B (E, rank, N), each expert's rows through its own
(`jax.lax.ragged_dot` by the op's group sizes, an einsum batched over the expert axis expert by
expert, `w[i]` through A[i] and B[i]). nnx keeps them as `nnx.LoRAParam` attributes `<param>_lora_a` /
`<param>_lora_b` of the module (so `nnx.DiffState(0, nnx.LoRAParam)` trains only them), linen
as params of those names beside the Q8 param. On a mesh the adapters follow their base's split
(A along K as a row-parallel base, B along N as a column-parallel one): a new adapter is
annotated and placed as its base's Q8 values are (`q8rules.lora.placement`), and
`q8rules.sharding.shard_params` splits them so. Products matched by a plain `Q8Rule` of the same
provider are served as Q8_0 without an adapter. The gradient reaches A and B through the delta;
the base's gradient in x runs the Q8_0 transposed product (op 'matmul_t').
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.nn import initializers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from q8rules._qwix import (
  WithAux,
  find_param,
  get_or_create_param,
  initial_run_complete,
  make_rng,
  provider_rules,
)
from q8rules.kernels.layer import LayerSlice
from q8rules.layout import ProductLayout
from q8rules.lora.placement import init_like_base
from q8rules.providers import views
from q8rules.providers.policy import CurrentRule, op_where
from q8rules.providers.products import Product
from q8rules.providers.q8_weight import Q8Weight
from q8rules.providers.serving import Q8Provider, ServePolicy
from q8rules.rules import Q8Rule, describe
from q8rules.sharding.adapters import LORA_A, LORA_B
from q8rules.sharding.product import type_spec
from q8rules.sharding.specs import spec_entries


@dataclasses.dataclass(frozen=True, kw_only=True)
class Q8LoraRule(Q8Rule):
  """A `Q8Rule` whose matched products also get a LoRA adapter (see the module).

  Attributes:
    rank: the adapter's rank r (A is (K, r), B is (r, N)); at most min(K, N) of each product.
    alpha: the delta's scale is alpha / rank; > 0.
    dropout: the rate of the dropout on x before A (0: none; it draws from the 'dropout' rng
      stream: linen `rngs={'dropout': key}`, nnx the `rngs` given to `apply_lora_to_model`).
    lora_a_initializer: `init(key, shape, dtype)` of A (default He-uniform, as Qwix's).
    lora_b_initializer: `init(key, shape, dtype)` of B (default zeros: the adapted model starts
      as the Q8_0 model, bit for bit).
    params: regexes, one of which must fullmatch the name of a product's Q8 param in its module
      ('kernel', 'up_exps') for the product to get an adapter; the rule's other products are
      served as Q8_0 without one. (): every product the rule matches (the default).
  """

  rank: int
  alpha: float
  dropout: float = 0.0
  lora_a_initializer: Callable[..., jax.Array] = initializers.he_uniform()
  lora_b_initializer: Callable[..., jax.Array] = initializers.zeros
  params: tuple[str, ...] = ()

  def __post_init__(self) -> None:
    """Refuse a rank below 1, alpha <= 0 or a dropout rate outside [0, 1), naming the rule."""
    super().__post_init__()
    problems = []
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      problems.append(f"rank={self.rank!r} (a positive int)")
    if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
      problems.append(f"alpha={self.alpha!r} (a finite number > 0)")
    if not (isinstance(self.dropout, int | float) and 0 <= self.dropout < 1):
      problems.append(f"dropout={self.dropout!r} (a rate in [0, 1))")
    if problems:
      raise ValueError(
        f"Q8LoraRule for module_path={self.module_path!r} cannot take {'; '.join(problems)}"
      )

  @property
  def scale(self) -> float:
    """alpha / rank, the factor on x @ A @ B."""
    return self.alpha / self.rank


def lora_delta(
  x: jax.Array,
  a: jax.Array,
  b: jax.Array,
  layout: ProductLayout,
  scale: float,
  group_sizes: jax.Array | None = None,
) -> jax.Array:
  """`x @ A @ B * scale` in the product's output shape, in float32 at full precision; on a stack
  of experts, each row (or batch of rows) through its own expert's adapter.

  Args:
    x: the activation as the op got it (any rank, any float dtype; after dropout).
    a: A (K, rank) float32, K the weight's contracted size (unpadded); for a grouped or batched
      product one per expert, (*E, K, rank).
    b: B (rank, N) float32, N the weight's kept size; (*E, rank, N) with A's experts.
    layout: the product's layout (how x flattens to (M, K), or (E, M, K) for a batched product,
      and (M, N) unflattens).
    scale: alpha / rank.
    group_sizes: a grouped product's (`jax.lax.ragged_dot`) rows per expert, (E,) int32; x's
      rows are sorted by expert.

  Returns:
    float32 of the op's output shape.
  """
  k, n, rank = layout.weight.k, layout.weight.n, a.shape[-1]
  xm = layout.lhs_matrix(x.astype(jnp.float32))[..., :k]
  hi = jax.lax.Precision.HIGHEST
  if group_sizes is not None:  # rows sorted by expert
    xa = jax.lax.ragged_dot(xm, a.reshape(-1, k, rank), group_sizes, precision=hi)
    d = jax.lax.ragged_dot(xa, b.reshape(-1, rank, n), group_sizes, precision=hi)
  elif layout.batched:  # each expert's rows (E, M, K)
    xa = jnp.einsum("emk,ekr->emr", xm, a.reshape(-1, k, rank), precision=hi)
    d = jnp.einsum("emr,ern->emn", xa, b.reshape(-1, rank, n), precision=hi)
  else:
    xa = jnp.dot(xm, a, precision=hi, **_xa_sharding(xm, a))
    d = jnp.dot(xa, b, precision=hi)
  return layout.output(d * jnp.float32(scale), tuple(x.shape))


@dataclasses.dataclass(frozen=True)
class Experts:
  """How a product's weight stands in its stack of experts, for the adapters' shape.

  Attributes:
    shape: the experts' sizes, the adapters' leading axes (A (*shape, K, rank)); () for a
      plain weight.
    index: the expert a `w[i]` view reads (its adapters A[i], B[i]), or None.
  """

  shape: tuple[int, ...] = ()
  index: int | None = None


def experts_of(product: Product, q8: WithAux, layout: ProductLayout, where: str) -> Experts:
  """The experts of a product's Q8 weight: the stack a grouped (`ragged_dot`) or batched einsum
  product runs on, or the stack a `w[i]` view takes one of.

  Raises NotImplementedError, naming the op, for a view of a stack it cannot place an adapter on
  (several expert axes indexed, or more than one expert axis in a `w[i]` view's stack)."""
  if product.group_sizes is not None or layout.batched:
    return Experts(layout.weight.batch_shape)
  chain = q8.chain if isinstance(q8, Q8Weight) else ()
  picks = [op for op in chain if isinstance(op, views.Index)]
  if not picks:
    return Experts()
  stacked = q8.array.stacked if isinstance(q8.array, LayerSlice) else None
  if len(picks) > 1 or stacked is None or stacked.q.ndim != 3:
    raise NotImplementedError(
      f"{where}: a LoRA adapter per expert on the view {views.describe(chain)} of a stack of"
      " experts: served for w[i] of an (E, ...) stack with one expert axis"
    )
  return Experts((int(stacked.q.shape[0]),), picks[0].index)


def _xa_sharding(x2d: jax.Array, a: jax.Array) -> dict[str, Any]:
  """`out_sharding` of x @ A (M, rank) where a mesh with explicit axes types x or A: the rows
  split as x's, the rank whole (JAX asks for it when both split K, the row-parallel case: the
  partial sums are added); {} otherwise (XLA propagates)."""
  typed = {"x": type_spec(x2d), "A": type_spec(a)}
  if all(t is None for t in typed.values()):
    return {}
  mesh = jax.typeof(x2d if typed["x"] is not None else a).sharding.mesh
  rows = spec_entries(typed["x"], 2, "x")[0] if typed["x"] is not None else None
  return {"out_sharding": NamedSharding(mesh, P(rows, None))}


def _param_name(q8: WithAux) -> str | None:
  """The name, in the current module, of the param the Q8 weight `q8` is (or is a view of)."""
  if isinstance(q8, Q8Weight) and q8.name:
    return q8.name.rsplit("/", 1)[-1]
  return find_param(q8, WithAux)


def _initial(
  init: Callable[..., jax.Array], shape: tuple[int, ...], where: str
) -> Callable[[jax.Array], jax.Array]:
  """`init(key)` -> the float32 adapter param of `shape`, its shape checked: (rows, cols), or
  one such matrix per expert (*E, rows, cols), each initialised as a matrix of its own (a key
  each), as PEFT initialises an expert's adapter."""
  *experts, rows, cols = shape

  def one(key: jax.Array) -> jax.Array:
    value = jnp.asarray(init(key, (rows, cols), jnp.float32), jnp.float32)
    if tuple(value.shape) != (rows, cols):
      raise ValueError(f"{where}: the initializer made shape {value.shape}, not {(rows, cols)}")
    return value

  def run(key: jax.Array) -> jax.Array:
    if not experts:
      return one(key)
    keys = jax.random.split(key, math.prod(experts))
    return jax.vmap(one)(keys).reshape(shape)

  return run


class LoraPolicy(ServePolicy):
  """The LoRA mode: served as `ServePolicy` serves, plus the adapter's delta on each product a
  `Q8LoraRule` matched (see the module).

  Attributes:
    adapted_rules: ids of the `Q8LoraRule`s that put an adapter on a product so far.
  """

  def __init__(self, rules: Any, current_rule: CurrentRule):
    super().__init__(rules, current_rule)
    self.adapted_rules: set[int] = set()

  def adapted(
    self, product: Product, q8: WithAux, layout: ProductLayout, y: jax.Array
  ) -> jax.Array:
    """`y` plus the adapter's delta when a `Q8LoraRule` matched the product (see the module)."""
    rule = product.rule
    if not isinstance(rule, Q8LoraRule):
      return y
    where = op_where(product.op_id)
    name = _param_name(q8)
    if name is None:
      raise ValueError(f"{where}: cannot find the param of the Q8 weight to attach LoRA to")
    if rule.params and not any(re.fullmatch(p, name) for p in rule.params):
      return y
    experts = experts_of(product, q8, layout, where)
    k, n = layout.weight.k, layout.weight.n
    if rule.rank > min(k, n):
      raise ValueError(
        f"{where}: LoRA rank {rule.rank} exceeds min(K, N) = {min(k, n)} of its weight"
        f" (K={k}, N={n}); in {describe(rule)}"
      )
    shape_a, shape_b = (*experts.shape, k, rule.rank), (*experts.shape, rule.rank, n)
    a = get_or_create_param(
      name + LORA_A,
      init_like_base(_initial(rule.lora_a_initializer, shape_a, where), name, "a", where),
      nnx_param_type=nnx.LoRAParam,
      need_rng=True,
    )
    b = get_or_create_param(
      name + LORA_B,
      init_like_base(_initial(rule.lora_b_initializer, shape_b, where), name, "b", where),
      nnx_param_type=nnx.LoRAParam,
      need_rng=True,
    )
    for param, want in ((a, shape_a), (b, shape_b)):
      if tuple(param.shape) != want:
        raise ValueError(
          f"{where}: LoRA param of shape {tuple(param.shape)} does not match {want}"
          f" (rank {rule.rank}, K={k}, N={n}, experts {experts.shape})"
        )
    if experts.index is not None:  # w[i]: expert i's adapter
      a, b = a[experts.index], b[experts.index]
    x = product.lhs
    if rule.dropout > 0:
      x = nnx.Dropout(rule.dropout, deterministic=False)(x, rngs=make_rng("dropout"))
    self.adapted_rules.add(id(rule))
    delta = lora_delta(x, a, b, layout, rule.scale, product.group_sizes)
    return y.astype(jnp.float32) + delta


class Q8LoraProvider(Q8Provider):
  """Serve matched weights as Q8_0 and add LoRA adapters where a `Q8LoraRule` matched.

  Use as Qwix's `LoraProvider`: `qwix.apply_lora_to_model(model, provider, *inputs,
  rngs=nnx.Rngs(0))` for nnx, `qwix.quantize_model(model, provider)` then `init`/`apply` for
  linen. Rules are `Q8LoraRule`s and plain `Q8Rule`s (served without an adapter), or, as
  `qwix.LoraProvider` takes them, the fields of one `Q8LoraRule` as keywords.

  Raises (at the first run) ValueError naming the rule's module_path when a `Q8LoraRule` put an
  adapter on no product (its regex matched no served dot_general/einsum).
  """

  def __init__(
    self, rules: Sequence[Q8Rule] | None = None, *, disable_jit: bool = False, **kwargs: Any
  ):
    if rules is None:
      rules = [Q8LoraRule(**kwargs)]
    elif kwargs:
      raise ValueError("Q8LoraProvider takes rules or the fields of one Q8LoraRule, not both")
    super().__init__(rules, disable_jit=disable_jit)

  policy: LoraPolicy

  def make_policy(self, rules: Any, current_rule: CurrentRule) -> LoraPolicy:
    return LoraPolicy(rules, current_rule)

  def process_model_output(self, method_name: str, model_output: Any) -> Any:
    first = not initial_run_complete(self)
    out = super().process_model_output(method_name, model_output)
    if first:
      idle = [
        r
        for r in provider_rules(self)
        if isinstance(r, Q8LoraRule) and id(r) not in self.policy.adapted_rules
      ]
      if idle:
        raise ValueError(
          "Q8LoraProvider: LoRA rule(s) put an adapter on no served product (their"
          " module_path matched no dot_general/einsum on a Q8 weight): "
          + "; ".join(f"module_path={r.module_path!r}: {describe(r)}" for r in idle)
        )
    return out
