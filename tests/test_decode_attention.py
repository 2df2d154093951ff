"""One new token's attention over a layer of the KV cache (`q8rules.kernels.decode_attention`):
the native CPU kernel against a float64 numpy reference and against the decoder's own XLA
attention (float32 and bfloat16 caches, grouped-query heads, softcap, attention sinks, rows at
their own positions, positions past the cache's end clamped), its gradients (the
reference's), how the implementation is chosen (per backend, per lowering platform, under a
mesh), and the decoder's logits either way (sliding-window and full layers with sinks)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix

import q8rules
from q8rules.kernels.decode_attention import api as decode_attention
from q8rules.kernels.decode_attention import cpu as attention_cpu
from q8rules.kernels.decode_attention import cpu as native_attention
from q8rules.kernels.decode_attention.problem import AttentionProblem
from q8rules.kernels.native import library as native_lib
from q8rules.kernels.native import simd as native_simd
from q8rules.models import Transformer, TransformerConfig, init_cache
from q8rules.models.attention import _attend_f32
from tests._utils import matrix, rel_err

NATIVE = native_lib.available()
needs_native = pytest.mark.skipif(
  not NATIVE, reason=f"native kernel: {native_lib.unavailable_reason()}"
)


def reference64(q, keys, values, slot, pos, scale, softcap, sinks=None):
  """float64 numpy: q (B, 1, H, D), keys / values (L, B, S, KV, D), pos a position or one per
  row, sinks (H,) or None -> (B, 1, H * D). A sink is one more term of its head's
  denominator: p_s = exp(s_s) / (sum_s' exp(s_s') + exp(sink))."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, keys[slot], values[slot]))
  b, _, h, d = q.shape
  group = h // k.shape[2]
  rows = np.broadcast_to(np.asarray(pos), (b,))
  out = np.empty((b, h, d))
  for i in range(b):
    n = min(int(rows[i]) + 1, k.shape[1])
    for j in range(h):
      s = k[i, :n, j // group] @ q[i, 0, j] * scale
      if softcap:
        s = np.tanh(s / softcap) * softcap
      top = s.max() if sinks is None else max(s.max(), float(sinks[j]))
      p = np.exp(s - top)
      total = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[j]) - top))
      out[i, j] = (p / total) @ v[i, :n, j // group]
  return out.reshape(b, 1, h * d)


def xla_reference(scale, softcap):
  """The decoder's own XLA attention (`models.attention._attend_f32`) as a `Reference`."""

  def ref(call):
    q, cache_k, cache_v, slot, pos = call.q, call.keys, call.values, call.slot, call.pos
    h, kv, d = q.shape[2], cache_k.shape[3], q.shape[3]
    c = TransformerConfig(
      vocab=8,
      dim=h * d,
      layers=1,
      heads=h,
      kv_heads=kv,
      head_dim=d,
      ffn=8,
      attn_scale=scale,
      attn_softcap=softcap,
    )
    keys = jax.lax.dynamic_index_in_dim(cache_k, slot, 0, keepdims=False)
    values = jax.lax.dynamic_index_in_dim(cache_v, slot, 0, keepdims=False)
    p = jnp.asarray(pos)
    visible = jnp.arange(keys.shape[1])[None] <= (p[:, None, None] if p.ndim else p)
    return _attend_f32(c, q, keys, values, visible, call.sinks)  # visible (1, S) or (B, 1, S)

  return ref


def operands(rng, b=2, layers=3, s=40, kv=2, h=6, d=64, dtype=np.float32):
  q = rng.standard_normal((b, 1, h, d)).astype(np.float32)
  keys = rng.standard_normal((layers, b, s, kv, d)).astype(dtype)
  values = rng.standard_normal((layers, b, s, kv, d)).astype(dtype)
  return q, keys, values


@needs_native
@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("pos", [0, 17, 39, 60])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_native_kernel_against_float64(rng, d, pos, softcap):
  q, keys, values = operands(rng, d=d)
  scale = 1 / np.sqrt(d)
  out = attention_cpu.decode_attention_cpu(
    jnp.asarray(q[:, 0]),
    jnp.asarray(keys),
    jnp.asarray(values),
    1,
    pos,
    scale=scale,
    softcap=softcap,
  )
  ref = reference64(q, keys, values, 1, pos, scale, softcap)
  assert out.dtype == jnp.float32
  assert rel_err(np.asarray(out).reshape(ref.shape), ref) < 1e-6


@needs_native
def test_native_kernel_reads_a_bfloat16_cache_exactly(rng):
  q, keys, values = operands(rng, dtype=ml_dtypes.bfloat16)
  out = attention_cpu.decode_attention_cpu(
    jnp.asarray(q[:, 0]),
    jnp.asarray(keys),
    jnp.asarray(values),
    2,
    25,
    scale=0.125,
    softcap=None,
  )
  ref = reference64(q, keys.astype(np.float32), values.astype(np.float32), 2, 25, 0.125, None)
  assert rel_err(np.asarray(out).reshape(ref.shape), ref) < 1e-6


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_native_kernel_gives_the_same_bits_on_every_simd_path(rng, monkeypatch, dtype, with_sinks):
  """The kernel is compiled once per path (SSE2, AVX2, AVX-512 on x86-64; NEON on aarch64;
  each path this CPU runs, by $Q8RULES_CPU_ISA, read on every call) with the same operations
  in the same order: the outputs are equal bit for bit, grouped-query heads (3 heads a KV
  head) and sinks included."""
  q, keys, values = operands(rng, s=70, kv=3, h=9, d=40, dtype=dtype)
  sinks = sink_logits(rng, 9) if with_sinks else None
  outs = {}
  for isa in native_simd.supported():
    monkeypatch.setenv("Q8RULES_CPU_ISA", isa)
    outs[isa] = np.asarray(
      attention_cpu.decode_attention_cpu(
        jnp.asarray(q[:, 0]),
        jnp.asarray(keys),
        jnp.asarray(values),
        1,
        65,
        scale=0.2,
        softcap=None,
        sinks=None if sinks is None else jnp.asarray(sinks),
      )
    )
  for isa, out in outs.items():
    np.testing.assert_array_equal(out, outs["scalar"], err_msg=isa)
  k32, v32 = keys.astype(np.float32), values.astype(np.float32)
  ref = reference64(q, k32, v32, 1, 65, 0.2, None, sinks)
  assert rel_err(outs["scalar"].reshape(ref.shape), ref) < 1e-6


@needs_native
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_cpu_equals_the_decoders_xla_attention(rng, softcap):
  q, keys, values = operands(rng)
  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.int32(2), jnp.int32(30))
  ref = xla_reference(0.125, softcap)
  run = functools.partial(decode_attention.one_token, scale=0.125, softcap=softcap, reference=ref)
  cpu = jax.jit(functools.partial(run, implementation="cpu"))(*args)
  xla = jax.jit(functools.partial(run, implementation="xla"))(*args)
  assert rel_err(np.asarray(cpu), np.asarray(xla)) < 1e-6
  assert rel_err(np.asarray(cpu), reference64(q, keys, values, 2, 30, 0.125, softcap)) < 1e-6


@needs_native
def test_gradients_are_the_references(rng):
  """Through the kernel, the gradients of q, keys, values and the sinks are the XLA
  attention's (no sinks: their gradient is not asked for)."""
  q, keys, values = operands(rng, b=1, layers=2, s=12, kv=1, h=2, d=16)
  ref = xla_reference(0.25, None)

  def loss(impl, q, k, v, sinks=None):
    out = decode_attention.one_token(
      q,
      k,
      v,
      jnp.int32(1),
      jnp.int32(7),
      scale=0.25,
      softcap=None,
      reference=ref,
      implementation=impl,
      sinks=sinks,
    )
    return jnp.sum(out * jnp.arange(out.size).reshape(out.shape))

  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values))
  with_sinks = (*args, jnp.asarray([0.5, -1.0], jnp.float32))
  pairs = list(
    zip(
      jax.grad(functools.partial(loss, "cpu"), argnums=(0, 1, 2))(*args),
      jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(*args),
      strict=True,
    )
  )
  pairs += zip(
    jax.grad(functools.partial(loss, "cpu"), argnums=(0, 1, 2, 3))(*with_sinks),
    jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2, 3))(*with_sinks),
    strict=True,
  )
  assert np.abs(np.asarray(pairs[-1][1])).min() > 0  # the sinks' own gradient is there
  for got, want in pairs:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def reason_now(q, keys):
  return native_attention.cannot(AttentionProblem.of(q, keys))


def test_implementation_choice_and_errors(rng):
  q, keys, values = operands(rng)
  ref = xla_reference(0.125, None)
  run = functools.partial(decode_attention.one_token, scale=0.125, softcap=None, reference=ref)
  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), 0, 3)
  with pytest.raises(
    ValueError, match=r"implementation='triton': expected None, one of \('cpu', 'xla'\)"
  ):
    run(*args, implementation="triton")
  two = jnp.concatenate([args[0], args[0]], axis=1)  # two new tokens: not this op's
  reason = native_attention.cannot(AttentionProblem.of(two, args[1]))
  assert reason is not None and ("one new token" in reason or not NATIVE)
  with pytest.raises(ValueError, match="cannot run decode_attention q .* 'cpu': "):
    run(two, *args[1:], implementation="cpu")
  problem = AttentionProblem.of(*args[:2])
  expected = q8rules.kernels.resolve("decode_attention", problem)
  assert expected == ("cpu" if jax.default_backend() == "cpu" and NATIVE else "xla")
  text = jax.jit(run).lower(*args).as_text()
  assert (native_lib.TARGET_DECODE_ATTENTION in text) == (expected == "cpu")
  one = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
  with jax.set_mesh(one):  # a one-device mesh shards nothing: the kernel still runs
    assert native_attention.cannot(AttentionProblem.of(*args[:2])) == reason_now(*args[:2])
  if len(jax.devices()) < 2:
    return
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):  # a mesh in context: XLA's partitioner runs the attention
    reason = native_attention.cannot(AttentionProblem.of(*args[:2]))
    assert reason is not None and ("mesh" in reason or not NATIVE)
    assert native_lib.TARGET_DECODE_ATTENTION not in jax.jit(run).lower(*args).as_text()


def test_reference_without_a_callers_attention(rng):
  """With no `reference`, 'xla' runs the op's own plain-JAX reference: float64 numbers."""
  q, keys, values = operands(rng, d=16)
  for softcap in (None, 5.0):
    out = decode_attention.one_token(
      jnp.asarray(q),
      jnp.asarray(keys),
      jnp.asarray(values),
      1,
      21,
      scale=0.25,
      softcap=softcap,
      implementation="xla",
    )
    assert rel_err(np.asarray(out), reference64(q, keys, values, 1, 21, 0.25, softcap)) < 1e-6


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_other_platforms_lower_the_xla_attention(rng, platform):
  """A program lowered for GPU or TPU (here, on any host) has no CPU custom call in it."""
  q, keys, values = operands(rng, b=1, layers=2, s=16, kv=1, h=2, d=16)
  run = functools.partial(
    decode_attention.one_token, scale=0.25, softcap=None, reference=xla_reference(0.25, None)
  )
  exported = jax.export.export(jax.jit(run), platforms=[platform])(
    jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.int32(0), jnp.int32(3)
  )
  assert native_lib.TARGET_DECODE_ATTENTION not in exported.mlir_module()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoder_logits_the_same_either_way(rng, dtype):
  """A decode step of the decoder (GQA, softcap): plain Flax runs its own XLA attention (no
  kernel in the program); under a q8rules provider its hook runs op 'decode_attention' (the
  kernel where it runs, as `kernels.resolve` says): the same logits to float32 rounding, and
  the params left byte-identical."""
  config = TransformerConfig(
    vocab=64,
    dim=48,
    layers=2,
    heads=6,
    kv_heads=2,
    head_dim=8,
    ffn=64,
    dtype=dtype,
    attn_softcap=20.0,
  )
  model = Transformer(config)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 5)), jnp.int32)
  params = model.init(jax.random.key(0), tokens, init_cache(config, 8, 2))
  _, cache = model.apply(params, tokens, init_cache(config, 8, 2))
  step = jnp.asarray(rng.integers(0, 64, (2, 1)), jnp.int32)
  args = (params, step, cache, jnp.int32(5))
  served = qwix.quantize_model(model, q8rules.Q8Provider([]))  # no product served: hooks only
  before = [np.asarray(a).tobytes() for a in jax.tree.leaves(params)]
  got, _ = jax.jit(served.apply)(*args)
  assert [np.asarray(a).tobytes() for a in jax.tree.leaves(params)] == before  # read-only
  want, _ = jax.jit(model.apply)(*args)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert rel_err(np.asarray(got), np.asarray(want)) < tol
  assert native_lib.TARGET_DECODE_ATTENTION not in jax.jit(model.apply).lower(*args).as_text()
  problem = AttentionProblem.of(jnp.zeros((2, 1, 6, 8)), cache[0])
  expected = q8rules.kernels.resolve("decode_attention", problem)
  text = jax.jit(served.apply).lower(*args).as_text()
  assert (native_lib.TARGET_DECODE_ATTENTION in text) == (expected == "cpu")


@needs_native
def test_native_kernel_refuses_mismatched_operands(rng):
  """Operands the wrapper would never build still get a clear error from the kernel, not a
  read past the cache: keys and values of other shapes, a layer outside the cache."""
  q, keys, values = operands(rng)
  call = functools.partial(attention_cpu.decode_attention_cpu, scale=0.125, softcap=None)
  # the kernel's InvalidArgument: JaxRuntimeError, or ValueError (jax 0.11, a cached executable)
  raised = (jax.errors.JaxRuntimeError, ValueError)
  with pytest.raises(raised, match=r"q8_decode_attention: expected q \(B, H, D\)"):
    jax.block_until_ready(
      call(jnp.asarray(q[:, 0]), jnp.asarray(keys), jnp.asarray(values[:, :, :7]), 0, 3)
    )
  with pytest.raises(raised, match="q8_decode_attention: the layer is outside the cache"):
    jax.block_until_ready(call(jnp.asarray(q[:, 0]), jnp.asarray(keys), jnp.asarray(values), 3, 3))


def test_one_export_carries_each_platforms_attention(rng):
  """One `jax.export` for ('cpu', 'cuda', 'tpu'): the CPU module calls the native kernel where
  `kernels.resolve` picks it for the CPU, the others run the XLA attention; the artifact runs
  here and matches the float64 reference."""
  q, keys, values = operands(rng, b=1, layers=2, s=16, kv=1, h=2, d=16)
  run = functools.partial(
    decode_attention.one_token, scale=0.25, softcap=None, reference=xla_reference(0.25, None)
  )
  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.int32(1), jnp.int32(9))
  platforms = ("cpu", "cuda", "tpu")
  with q8rules.kernels.lowering_context(platforms):
    exp = jax.export.export(
      jax.jit(run), platforms=platforms, disabled_checks=q8rules.export_checks()
    )(*args)
  on_cpu = q8rules.kernels.resolve("decode_attention", AttentionProblem.of(q, keys, "cpu"))
  assert (native_lib.TARGET_DECODE_ATTENTION in exp.mlir_module()) == (on_cpu == "cpu")
  ref = reference64(q, keys, values, 1, 9, 0.25, None)
  assert rel_err(np.asarray(exp.call(*args)), ref) < 1e-6


def sink_logits(rng, h):
  """(H,) float32 sink logits: ordinary ones, one above every score of its head (the sink
  takes most of that head's weight and sets its max) and one far below (it takes none)."""
  sinks = (rng.standard_normal(h) * 2).astype(np.float32)
  sinks[0], sinks[-1] = 6.0, -40.0
  return sinks


@needs_native
@pytest.mark.parametrize(
  "dtype", matrix([np.float32, ml_dtypes.bfloat16], np.float32), ids=["f32", "bf16"]
)
@pytest.mark.parametrize(("kv", "h"), [(2, 6), (1, 4), (4, 4)], ids=["gqa3", "mqa", "mha"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_native_kernel_with_sinks_against_float64(rng, dtype, kv, h, softcap):
  """Heads with sinks (gpt-oss's), rows at their own positions: the first alone, one inside,
  the last slot, and one past the end (a full sliding-window ring read whole), on the
  kernel, on the op's plain-JAX reference and on the decoder's XLA attention: float64's
  numbers to float32 rounding."""
  q, keys, values = operands(rng, b=4, s=40, kv=kv, h=h, d=64, dtype=dtype)
  sinks = sink_logits(rng, h)
  pos = np.asarray([0, 13, 39, 70], np.int32)
  k32, v32 = keys.astype(np.float32), values.astype(np.float32)
  ref = reference64(q, k32, v32, 1, pos, 0.125, softcap, sinks)
  kernel = attention_cpu.decode_attention_cpu(
    jnp.asarray(q[:, 0]),
    jnp.asarray(keys),
    jnp.asarray(values),
    1,
    jnp.asarray(pos),
    scale=0.125,
    softcap=softcap,
    sinks=jnp.asarray(sinks),
  )
  assert rel_err(np.asarray(kernel).reshape(ref.shape), ref) < 1e-6
  first = slice(0, 64)  # head 0, whose sink outweighs its scores
  assert rel_err(np.asarray(kernel)[:, 0], ref[:, 0, first]) < 1e-6
  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.int32(1), jnp.asarray(pos))
  run = functools.partial(decode_attention.one_token, scale=0.125, softcap=softcap)
  for reference in (None, xla_reference(0.125, softcap)):
    for impl in ("cpu", "xla"):
      out = jax.jit(functools.partial(run, reference=reference, implementation=impl))(
        *args, sinks=jnp.asarray(sinks)
      )
      assert rel_err(np.asarray(out), ref) < 1e-6, (reference, impl)
  plain = reference64(q, k32, v32, 1, pos, 0.125, softcap)  # the sinks change the numbers
  assert rel_err(np.asarray(kernel).reshape(ref.shape), plain) > 1e-2


@needs_native
def test_native_kernel_with_sinks_rows_are_each_row_alone(rng):
  """One call for a batch of rows at their own positions, with sinks: row b is the same bits
  as row b alone."""
  q, keys, values = operands(rng, b=3, s=24, kv=2, h=6, d=40)
  sinks = jnp.asarray(sink_logits(rng, 6))
  pos = np.asarray([5, 23, 2], np.int32)
  call = functools.partial(attention_cpu.decode_attention_cpu, scale=0.2, softcap=None, sinks=sinks)
  batch = np.asarray(call(jnp.asarray(q[:, 0]), jnp.asarray(keys), jnp.asarray(values), 2, pos))
  for i in range(3):
    alone = call(
      jnp.asarray(q[i : i + 1, 0]),
      jnp.asarray(keys[:, i : i + 1]),
      jnp.asarray(values[:, i : i + 1]),
      2,
      int(pos[i]),
    )
    np.testing.assert_array_equal(batch[i : i + 1], np.asarray(alone))


@needs_native
def test_sinks_of_another_shape_are_refused(rng):
  """Sinks other than one logit per head: the op's ValueError, and the kernel's own error
  for operands the op would never build."""
  q, keys, values = operands(rng)
  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), 0, 3)
  for impl in ("cpu", "xla"):
    with pytest.raises(ValueError, match=r"sinks must be one logit per head \(6,\), got \(5,\)"):
      decode_attention.one_token(
        *args, scale=0.125, softcap=None, implementation=impl, sinks=jnp.zeros(5)
      )
  raised = (jax.errors.JaxRuntimeError, ValueError)
  with pytest.raises(raised, match=r"q8_decode_attention: expected sinks of one logit per head"):
    jax.block_until_ready(
      attention_cpu.decode_attention_cpu(
        jnp.asarray(q[:, 0]), *args[1:], scale=0.125, softcap=None, sinks=jnp.zeros(5)
      )
    )


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.slow
def test_decoder_with_sinks_the_same_either_way(rng, scan):
  """gpt-oss's attention (sinks on every head, sliding-window layers beside full ones, GQA):
  two rows prefilled to their own lengths (7 and 2 tokens), then decoded a token at a time at
  their own positions past the window of 3 (the rings wrap). Plain Flax runs its XLA
  attention; under a q8rules provider the hook runs op 'decode_attention' with the sinks
  (the kernel where `kernels.resolve` picks it): the same logits to float32 rounding."""
  config = TransformerConfig(
    vocab=64,
    dim=48,
    layers=4,
    heads=6,
    kv_heads=2,
    head_dim=8,
    ffn=64,
    attn_sinks=True,
    sliding_window=3,
    local_layers=(True, False, True, False),
    scan_layers=scan,
  )
  model = Transformer(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32), init_cache(config, 16))
  params = jax.tree_util.tree_map_with_path(  # the sinks init as zeros: draw them
    lambda path, a: (
      jnp.asarray(rng.standard_normal(a.shape) * 2, a.dtype)
      if "sinks" in jax.tree_util.keystr(path)
      else a
    ),
    params,
  )
  served = qwix.quantize_model(model, q8rules.Q8Provider([]))  # no product served: hooks only
  lengths = (7, 2)
  rows = []
  for n in lengths:  # each row prefilled alone, then the caches side by side
    tokens = jnp.asarray(rng.integers(0, 64, (1, n)), jnp.int32)
    rows.append(model.apply(params, tokens, init_cache(config, 16), 0)[1])
  cache = jax.tree.map(lambda *a: jnp.concatenate(a, axis=1), *rows)
  step_plain, step_served = jax.jit(model.apply), jax.jit(served.apply)
  ours, theirs = cache, cache
  for i in range(5):
    tok = jnp.asarray(rng.integers(0, 64, (2, 1)), jnp.int32)
    pos = jnp.asarray([n + i for n in lengths], jnp.int32)
    want, theirs = step_plain(params, tok, theirs, pos)
    got, ours = step_served(params, tok, ours, pos)
    assert rel_err(np.asarray(got), np.asarray(want)) < 1e-6, i
  args = (params, tok, cache, pos)
  assert native_lib.TARGET_DECODE_ATTENTION not in step_plain.lower(*args).as_text()
  problem = AttentionProblem.of(jnp.zeros((2, 1, 6, 8)), cache["global"][0])
  expected = q8rules.kernels.resolve("decode_attention", problem)
  text = step_served.lower(*args).as_text()
  assert (native_lib.TARGET_DECODE_ATTENTION in text) == (expected == "cpu")
