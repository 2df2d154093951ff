"""Helpers shared by the tests: float64 references, fresh random Q8_0 data, a GGUF writer, a
matrix of cases split between the README's test command and the slow step."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.kernels import lowering_context as lowering_for  # noqa: F401 (tests import it here)
from q8rules.q8_0 import BLOCK, Q8Array, quantize


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64."""
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def weights(rng: np.random.Generator, *shape: int) -> np.ndarray:
  """float32 weights of `shape` (never zero) whose magnitudes vary by row (10**-3 to 10**2,
  a row being all but the last axis) and by element (a further 10**-1 to 10**1)."""
  w = rng.standard_normal(shape).astype(np.float32)
  w *= 10.0 ** rng.uniform(-3, 2, (*shape[:-1], 1))
  w *= 10.0 ** rng.uniform(-1, 1, shape).astype(np.float32)
  return w.astype(np.float32)


def q8_weights(rng: np.random.Generator, k: int, n: int, scale_dtype=jnp.float32) -> Q8Array:
  """`quantize(weights(rng, k, n))`: a Q8_0 weight (K, N), one `scale_dtype` scale per 32 rows."""
  return quantize(weights(rng, k, n), scale_dtype=scale_dtype)


def random_q8(
  rng: np.random.Generator, k: int, n: int, scale_dtype=np.float32
) -> tuple[jax.Array, jax.Array]:
  """Random Q8_0 parts: q (K, N) int8 in [-127, 127], scale (K/32, N) of `scale_dtype`, > 0."""
  q = rng.integers(-127, 128, size=(k, n)).astype(np.int8)
  scale = (rng.uniform(0.5, 2.0, size=(k // BLOCK, n)) * 10.0 ** rng.uniform(-3, 0)).astype(
    scale_dtype
  )
  return jnp.asarray(q), jnp.asarray(scale)


def weight64(q, scale) -> np.ndarray:
  """The dequantised weight in float64: (K, N)."""
  return np.asarray(q, np.float64) * np.repeat(np.asarray(scale, np.float64), BLOCK, axis=0)


def random_x(rng: np.random.Generator, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """Standard normal activations of `shape`, as float32 then cast to `dtype`."""
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def close_to_float64(out, x, w64: np.ndarray, tol: float) -> bool:
  """`rel_err(out, x @ W) <= tol * max(1, cond)` against float64, cond = ||abs(x) @ abs(W)|| /
  ||x @ W||: float32 sums carry an error relative to the magnitudes they add, so a product
  whose terms cancel (one output of K = 32, say) is held to that, not to its small result."""
  x64 = np.asarray(x, np.float64)
  ref = x64 @ w64
  cond = np.linalg.norm(np.abs(x64) @ np.abs(w64)) / np.linalg.norm(ref)
  return rel_err(out, ref) <= tol * max(1.0, cond)


def write_gguf(path, tensors: dict, kv: dict | None = None, arch: str = "llama") -> None:
  """A GGUF file by gguf.GGUFWriter: name -> float array, or (raw uint8 bytes, type)."""
  writer = gguf.GGUFWriter(path, arch)
  for key, (value, vtype) in (kv or {}).items():
    writer.add_key_value(key, value, vtype, gguf.GGUFValueType.STRING if key == "strs" else None)
  for name, value in tensors.items():
    if isinstance(value, tuple):
      writer.add_tensor(name, value[0], raw_dtype=value[1])
    else:
      writer.add_tensor(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def copy_gguf(src, dst, convert=None, **writer_kw) -> None:
  """`src` (a GGUF file) written to `dst` by gguf.GGUFWriter: its metadata as it is, each
  tensor `t` (a gguf.ReaderTensor) as `convert(t)` gives it, an array (written by its dtype)
  or (raw bytes, GGML type); by default the file's own bytes and type. `writer_kw`: more
  arguments of GGUFWriter (e.g. split_max_tensors)."""
  r = gguf.GGUFReader(src)
  w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents(), **writer_kw)
  for key, field in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    vtype = gguf.GGUFValueType(field.types[0])
    sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(key, field.contents(), vtype, sub)
  for t in r.tensors:
    out = convert(t) if convert else (np.asarray(t.data), t.tensor_type)
    if isinstance(out, tuple):
      w.add_tensor(t.name, out[0], raw_dtype=out[1])
    else:
      w.add_tensor(t.name, out)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def matrix(values, *fast):
  """A test's parameter values, those in `fast` as they are and the others marked `slow`: the
  README's test command runs a test's `fast` cases, `.ci/run`'s slow step (`pytest -m slow`)
  the whole matrix. A tuple is one case of several names. Spread the `fast` picks over a file's tests so that each value (an arch, a
  variant) still runs somewhere in the README's command."""
  missing = [f for f in fast if f not in values]
  if missing or not fast:
    raise ValueError(f"fast cases {missing or '(none)'} are not among {list(values)}")
  slow = pytest.mark.slow
  return [
    v
    if v in fast
    else pytest.param(*v, marks=slow)
    if isinstance(v, tuple)
    else pytest.param(v, marks=slow)
    for v in values
  ]
