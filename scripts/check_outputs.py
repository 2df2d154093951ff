"""Save, or compare against a saved set, the outputs of every op and backend form q8rules runs
here: a refactor's proof that it changed no bit.

    python scripts/check_outputs.py save DIR     # before the change
    python scripts/check_outputs.py compare DIR  # after: each case np.array_equal, or named

Cases (fresh random data, fixed seeds): the weight-only product through every implementation
that runs on this host ('fold' in interpret mode, 'cpu' at each SIMD cap the CPU has, 'xla',
'xla_dequant', 'reference') over decode and prefill shapes, float32 / bfloat16 / float16
activations, float32 / float16 scales, whole and stacked (one layer read in place); its vmap
and gradients; the transposed product (op 'matmul_t': 'cpu' at each SIMD cap, 'xla',
'reference'); the Q8_0-activation product ('cpu', 'xla'); one token's decode attention; the
GGUF repack; and the logits of the tiny GGUF models of tests/data (prefill and decode steps,
scanned and unrolled). Only public entry points are called, so the script runs unchanged on
both sides of a refactor that moves modules.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import q8rules
from q8rules.kernels.layer import LayerSlice

Case = tuple[str, Callable[[], np.ndarray]]
DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "gguf_models"


def _weight(rng: np.random.Generator, k: int, n: int, scale_dtype: str, layers: int = 0):
  if layers:
    parts = [_weight(rng, k, n, scale_dtype) for _ in range(layers)]
    return q8rules.Q8Array(jnp.stack([p.q for p in parts]), jnp.stack([p.scale for p in parts]))
  w = rng.standard_normal((k, n)).astype(np.float32)
  return q8rules.quantize(jnp.asarray(w), scale_dtype=scale_dtype)


def _isas() -> list[str]:
  from q8rules.kernels.native import simd as native_simd

  best = native_simd.isa("best")
  order = ["scalar", "avx2", "avx512"]
  return order[: order.index(best) + 1] if best in order else []


def product_cases() -> Iterator[Case]:
  shapes = [(1, 64, 48), (3, 256, 600), (8, 1024, 576), (16, 2048, 96), (40, 512, 264)]
  impls = ["xla", "xla_dequant", "reference", "fold"]
  for m, k, n in shapes:
    for dtype in ("float32", "bfloat16", "float16"):
      for scale_dtype in ("float32", "float16"):
        rng = np.random.default_rng(zlib.crc32(f"{m} {k} {n} {dtype} {scale_dtype}".encode()))
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        w = _weight(rng, k, n, scale_dtype)
        stacked = _weight(rng, k, n, scale_dtype, layers=3)
        dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
        yield from _transposed_cases(f"{m}x{k}x{n}/{dtype}/{scale_dtype}", dy, w)
        names = [i for i in impls if q8rules.kernels.why_not(i, m, k, n, dtype, "cpu") is None]
        for impl in names + ["cpu"] * ("cpu" in _cpu_names(m, k, n, dtype)):
          caps = _isas() if impl == "cpu" else [None]
          for cap in caps:
            tag = f"matmul/{impl}{'@' + cap if cap else ''}/{m}x{k}x{n}/{dtype}/{scale_dtype}"
            yield (
              tag,
              _with_isa(cap, lambda x=x, w=w, i=impl: q8rules.q8_matmul(x, w, implementation=i)),
            )
            yield (
              tag + "/layer1",
              _with_isa(
                cap,
                lambda x=x, s=stacked, i=impl: jax.jit(
                  lambda x, s, j: q8rules.q8_matmul(x, LayerSlice(s, j), implementation=i)
                )(x, s, jnp.int32(1)),
              ),
            )
            if dtype == "float32" and scale_dtype == "float32":
              yield tag + "/grad", _with_isa(cap, lambda x=x, w=w, i=impl: _grad(x, w, i))
              if q8rules.kernels.why_not(impl, 3 * m, k, n, dtype, "cpu") is None:
                yield tag + "/vmap", _with_isa(cap, lambda x=x, w=w, i=impl: _vmap(x, w, i))
          if impl in ("cpu", "xla") and m <= 16:
            for cap in _isas() if impl == "cpu" else [None]:
              yield (
                f"act_q8_0/{impl}{'@' + cap if cap else ''}/{m}x{k}x{n}/{dtype}/{scale_dtype}",
                _with_isa(
                  cap,
                  lambda x=x, w=w, i=impl: q8rules.q8_matmul(
                    x, w, implementation=i, act_qtype="q8_0"
                  ),
                ),
              )


def _transposed_cases(shape: str, dy, w) -> Iterator[Case]:
  """Op 'matmul_t' (dy @ W^T, the gradient in x): 'cpu' at each SIMD cap, 'xla', 'reference'."""
  for impl, caps in (("cpu", _isas()), ("xla", [None]), ("reference", [None])):
    for cap in caps:
      yield (
        f"matmul_t/{impl}{'@' + cap if cap else ''}/{shape}",
        _with_isa(
          cap, lambda d=dy, w=w, i=impl: q8rules.kernels.q8_matmul_t(d, w, implementation=i)
        ),
      )


def _cpu_names(m: int, k: int, n: int, dtype: str) -> list[str]:
  return ["cpu"] if q8rules.kernels.why_not("cpu", m, k, n, dtype, "cpu") is None else []


def _grad(x, w, impl):
  def loss(x):
    return jnp.sum(jnp.sin(q8rules.q8_matmul(x, w, implementation=impl)))

  return jax.grad(loss)(x)


def _vmap(x, w, impl):
  xs = jnp.stack([x, 2 * x, -x])
  return jax.vmap(lambda x: q8rules.q8_matmul(x, w, implementation=impl))(xs)


def _with_isa(cap: str | None, fn: Callable[[], jax.Array]) -> Callable[[], np.ndarray]:
  def run() -> np.ndarray:
    old = os.environ.get("Q8RULES_CPU_ISA")
    if cap:
      os.environ["Q8RULES_CPU_ISA"] = cap
    try:
      return np.asarray(jax.block_until_ready(fn()))
    finally:
      if cap:
        if old is None:
          del os.environ["Q8RULES_CPU_ISA"]
        else:
          os.environ["Q8RULES_CPU_ISA"] = old

  return run


def repack_cases() -> Iterator[Case]:
  import gguf

  from q8rules.kernels.native import repack as native_repack

  for rows, k in ((48, 64), (600, 1024), (7, 4096)):
    rng = np.random.default_rng(rows * k)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))

    def run(blocks=blocks, rows=rows, k=k):
      out = np.zeros((1, k, rows), np.int8)
      scales = np.zeros((1, k // 32, rows), np.float16)
      assert native_repack.repack_q8_transposed(blocks.view(np.uint8).reshape(-1), out, scales)
      return np.concatenate([out.reshape(-1).view(np.uint8), scales.reshape(-1).view(np.uint8)])

    yield f"repack/{rows}x{k}", run


def model_cases() -> Iterator[Case]:
  from q8rules.llm import load_gguf

  for path in sorted(DATA.glob("*-q8_0.gguf")):
    for dtype in ("float32", "bfloat16"):
      for cap in _isas()[-1:] + _isas()[:1]:

        def run(path=path, dtype=dtype):
          m = load_gguf(path, dtype=dtype, progress=False)
          ids = list(range(1, 9))
          outs = [np.asarray(m.logits(ids))]
          for model in (m, m.unrolled()):
            outs += _decode(model, ids)
          return np.concatenate([o.reshape(-1) for o in outs])

        yield f"model/{path.stem}/{dtype}/isa={cap}", _with_isa(cap, run)


def _decode(m, ids) -> list[np.ndarray]:
  """The prefill's last logits and three single-token decode steps' (one-token attention)."""
  last, cache = m.prefill(ids, 3)
  out = [np.asarray(last)]
  for step in range(3):
    token = jnp.argmax(last).astype(jnp.int32).reshape(1, 1)
    logits, cache = m._run(token, cache, len(ids) + step)
    last = logits[0, -1]
    out.append(np.asarray(last))
  return out


def cases() -> Iterator[Case]:
  yield from product_cases()
  yield from repack_cases()
  yield from model_cases()


def main() -> int:
  mode, folder = sys.argv[1], Path(sys.argv[2])
  only = sys.argv[3] if len(sys.argv) > 3 else ""
  folder.mkdir(parents=True, exist_ok=True)
  bad, n, missing = [], 0, []
  for tag, fn in cases():
    if only not in tag:
      continue
    file = folder / (tag.replace("/", "__") + ".npy")
    out = fn()
    n += 1
    if mode == "save":
      np.save(file, out)
    elif not file.exists():
      missing.append(tag)
    else:
      ref = np.load(file)
      # bytes, not values: bfloat16 comes back from np.load as raw 2-byte records
      if (
        ref.shape != out.shape
        or ref.dtype.itemsize != out.dtype.itemsize
        or ref.tobytes() != out.tobytes()
      ):
        bad.append(tag)
        print("DIFFERS", tag, flush=True)
  if mode == "save":
    print(f"saved {n} cases in {folder}")
    return 0
  print(
    f"{n - len(bad) - len(missing)} of {n} cases bit-identical; {len(bad)} differ;"
    f" {len(missing)} not saved before"
  )
  for tag in missing:
    print("NOT SAVED", tag)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
