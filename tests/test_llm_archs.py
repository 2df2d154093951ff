"""`load_gguf` on the archs besides llama / qwen2: qwen3, gemma, gemma2, gemma3, phi3, and
Llama 3.1's rope_freqs, against a float64 forward and llama.cpp's outputs.

The tiny files (tests/data/gguf_models/tiny-<name>-*.gguf) and llama.cpp's logits and
greedy continuations on them (tiny-<name>.npz, F32 KV cache, flash attention off) are
made by scripts/make_gguf_references.py. The sliding-window models have a window of 8,
shorter than the 38-token sequences, so the local layers' ring buffers wrap.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm import GGUFModel, load_gguf
from q8rules.models.transformer import Transformer, init_cache
from tests._utils import matrix
from tests.gguf_numpy_forward import forward, gelu_fp16_table, load_float64

DATA = Path(__file__).parent / "data" / "gguf_models"
NAMES = ("llama31", "qwen3", "gemma", "gemma2", "gemma3", "phi3")

F32_VS_LLAMA_CPP = {"llama31": 1e-5, "qwen3": 1e-5, "phi3": 1e-5}
"""Per-position rel. L2 bound on the F32 files against llama.cpp (measured: 1.1e-6 to 3.9e-6).
The gemma archs are bounded by GEMMA_F32_VS_LLAMA_CPP instead (measured 3.1e-4 to 8.0e-4):
llama.cpp's CPU GELU reads a float16 table (test_gemma_gap_to_llama_cpp_is_its_float16_gelu)."""
GEMMA_F32_VS_LLAMA_CPP = 1.5e-3


@functools.cache
def model(name: str, kind: str) -> GGUFModel:
  return load_gguf(DATA / f"tiny-{name}-{kind}.gguf", dtype=jnp.float32, progress=False)


@functools.cache
def refs(name: str) -> dict[str, np.ndarray]:
  with np.load(DATA / f"tiny-{name}.npz") as z:
    return {k: z[k] for k in z.files}


@functools.cache
def float64(name: str, kind: str) -> tuple[dict, dict]:
  return load_float64(DATA / f"tiny-{name}-{kind}.gguf")


def rel_l2(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def run(m: GGUFModel, ids: np.ndarray, length: int) -> np.ndarray:
  """Logits (T, vocab) of one pass over ids with a KV cache of `length` positions."""
  out, _ = m._run(jnp.asarray(ids, jnp.int32)[None], init_cache(m.config, length), 0)
  return np.asarray(out[0])


EXPECTED = {
  "llama31": dict(rope_style="interleaved", rope_freq_factors=True, rope_base=500000.0),
  "qwen3": dict(rope_style="halves", qk_norm=True, head_dim=32, tied_embeddings=True),
  "gemma": dict(
    embed_scale=True, activation="gelu_tanh", kv_heads=1, head_dim=32, tied_embeddings=True
  ),
  "gemma2": dict(
    post_norms=True,
    attn_softcap=4.0,
    final_softcap=8.0,
    sliding_window=8,
    local_layers=(True, False, True, False),
    rope_base_local=10000.0,
  ),
  "gemma3": dict(
    post_norms=True,
    qk_norm=True,
    final_softcap=0.0,
    sliding_window=8,
    local_layers=(True,) * 5 + (False,),
    rope_base=1e6,
    rope_base_local=10000.0,
    rope_scaling="linear",
    rope_factor=8.0,
    rope_factor_local=1.0,
  ),
  "phi3": dict(
    fused_qkv=True,
    fused_gate_up=True,
    rope_long_short=True,
    rope_original_context=256,
    context_length=1024,
    sliding_window=0,  # llama.cpp turns Phi-3's window off
    tied_embeddings=False,
  ),
}


@pytest.mark.parametrize("name", NAMES)
def test_config_from_metadata(name):
  c = model(name, "q8_0").config
  for field, want in EXPECTED[name].items():
    assert getattr(c, field) == want, (field, getattr(c, field), want)
  assert c.scan_layers


@pytest.mark.parametrize("kind", ["q8_0", "f32"])
@pytest.mark.parametrize("name", matrix(NAMES, "qwen3", "gemma2"))
def test_logits_match_float64(name, kind):
  """float32 activations within 1e-5 rel. L2 of a float64 forward of the file's weights
  (HF's way), over prompt + 31 tokens: past the sliding window."""
  ids = refs(name)["q8_tokens"][:-1]
  ours = model(name, kind).logits(ids)
  ref = forward(*float64(name, kind), ids, n_ctx=64)
  assert rel_l2(ours, ref) < 1e-5


@pytest.mark.parametrize("name", matrix(NAMES, "llama31", "gemma3"))
def test_f32_logits_match_llama_cpp(name):
  """On the F32 file, every position against llama.cpp's logits (same context)."""
  r = refs(name)
  ids = r["f32_tokens"][:-1]
  ours = run(model(name, "f32"), ids, int(r["n_ctx"]))
  err = rel_l2(ours, r["f32_logits"], axis=-1)
  assert err.shape == (len(ids),)
  assert err.max() < F32_VS_LLAMA_CPP.get(name, GEMMA_F32_VS_LLAMA_CPP), err.max()


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix(["gemma", "gemma2", "gemma3"], "gemma"))
def test_gemma_gap_to_llama_cpp_is_its_float16_gelu(name):
  """The gemma archs' gap to llama.cpp is llama.cpp's CPU GELU (ggml reads it from a float16
  table): with every ffn_up zeroed (no GELU in either graph) we are within 1e-5 of
  llama.cpp at every position; and the float64 forward with that table emulated comes at
  least twice as close to llama.cpp as with the exact GELU (not to 1e-5: near a float16
  rounding boundary a tiny difference in the GELU's input flips the table entry)."""
  r, m = refs(name), model(name, "f32")
  ids = r["f32_tokens"][:-1]
  mlp = dict(
    m.params["layers"]["mlp"],
    up={"kernel": jnp.zeros_like(m.params["layers"]["mlp"]["up"]["kernel"])},
  )
  params = dict(m.params, layers=dict(m.params["layers"], mlp=mlp))
  out, _ = m.model.apply({"params": params}, jnp.asarray(ids)[None], init_cache(m.config, 256), 0)
  assert rel_l2(np.asarray(out[0]), r["f32_no_ffn_logits"], axis=-1).max() < 1e-5
  hp, w = float64(name, "f32")
  exact = rel_l2(forward(hp, w, ids), r["f32_logits"], axis=-1).max()
  table = rel_l2(forward(hp, w, ids, gelu=gelu_fp16_table), r["f32_logits"], axis=-1).max()
  assert 1e-5 < exact < GEMMA_F32_VS_LLAMA_CPP and table < exact / 2, (exact, table)


def clear_positions(theirs: np.ndarray) -> np.ndarray:
  """Where llama.cpp's top-1 beats its top-2 by more than 0.05 std of its logits."""
  top2 = np.sort(theirs, axis=-1)[:, -2:]
  return (top2[:, 1] - top2[:, 0]) > 0.05 * theirs.std(axis=-1)


@pytest.mark.parametrize("name", matrix(NAMES, "phi3", "gemma"))
def test_q8_argmax_matches_llama_cpp(name):
  """On the Q8_0 file (llama.cpp quantizes activations to Q8_0 there): our argmax equals
  llama.cpp's wherever its margin is clear, over prompt + 31 greedy tokens."""
  r = refs(name)
  ids = r["q8_tokens"][:-1]
  ours = run(model(name, "q8_0"), ids, int(r["n_ctx"]))
  clear = clear_positions(r["q8_logits"])
  assert clear.sum() >= len(ids) // 2
  agree = np.argmax(ours, -1) == np.argmax(r["q8_logits"], -1)
  assert agree[clear].all(), np.flatnonzero(clear & ~agree)


@pytest.mark.parametrize("kind", matrix(["q8_0", "f32"], "q8_0"))
@pytest.mark.parametrize("name", matrix(NAMES, "gemma3"))
def test_decode_past_the_window_equals_full_pass(name, kind):
  """Prefill a few tokens, then decode one token a step far past the window: the logits
  equal the one-pass logits, and the local layers' ring buffers stay the window's length."""
  m = model(name, kind)
  ids = refs(name)["q8_tokens" if kind == "q8_0" else "f32_tokens"][:-1]
  full = m.logits(ids)
  cache = m._cache(len(ids))
  steps, prefill = [], 3
  out, cache = m._run(jnp.asarray(ids[:prefill], jnp.int32)[None], cache, 0)
  steps.append(np.asarray(out[0]))
  for i in range(prefill, len(ids)):
    out, cache = m._run(jnp.asarray([[ids[i]]], jnp.int32), cache, i)
    steps.append(np.asarray(out[0]))
  assert rel_l2(np.concatenate(steps), full) < 1e-5
  c = m.config
  if c.sliding_window:
    assert len(ids) > 4 * c.sliding_window
    ring = (sum(c.local_layers), 1, c.sliding_window, c.kv_heads, c.head_dim)
    assert cache["local"][0].shape == ring
    assert cache["global"][0].shape[2] >= len(ids)


@pytest.mark.parametrize("name", matrix(NAMES, "llama31", "gemma2"))
def test_generate_follows_llama_cpp(name):
  """Greedy `generate` (prefill, then one token a step on the KV cache) on the F32 file picks
  the argmax of the one-pass logits at every step, and follows llama.cpp's continuation
  token by token up to llama.cpp's first unclear choice."""
  r, m = refs(name), model(name, "f32")
  prompt = r["prompt_ids"]
  new = m.generate(prompt, 32)
  seq = np.concatenate([prompt, new])
  np.testing.assert_array_equal(np.argmax(m.logits(seq[:-1])[len(prompt) - 1 :], -1), new)
  clear = clear_positions(r["f32_logits"])
  for i, tok in enumerate(new):
    pos = len(prompt) - 1 + i
    if not clear[pos]:
      break
    assert tok == r["f32_tokens"][pos + 1], (i, new, r["f32_tokens"][len(prompt) :])


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix(["gemma2", "gemma3"], "gemma3"))
def test_unrolled_layers_equal_scanned(name):
  """scan_layers=False (each layer's kind static) gives the scanned model's logits (each
  layer's attention under lax.cond) on a float model of the same config."""
  c = model(name, "f32").config
  ids = refs(name)["f32_tokens"][:-1][None]
  scanned = Transformer(c)
  params = scanned.init(jax.random.key(0), ids, init_cache(c, 64), 0)["params"]
  flat = dataclasses.replace(c, scan_layers=False)
  split = {k: v for k, v in params.items() if k != "layers"}
  for i in range(c.layers):
    split[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
  a, _ = scanned.apply({"params": params}, ids, init_cache(c, 64), 0)
  b, _ = Transformer(flat).apply({"params": split}, ids, init_cache(flat, 64), 0)
  assert rel_l2(a, b) < 1e-6


def test_phi3_long_factors_past_the_original_context():
  """Phi-3's LongRoPE: a KV cache longer than the original context (256) uses the long
  factors, as llama.cpp does with n_ctx 512; the short ones otherwise. Both agree with
  llama.cpp (F32) and with the float64 forward, and the two choices differ."""
  r, m = refs("phi3"), model("phi3", "f32")
  ids = r["f32_long_tokens"][:-1]
  long = run(m, ids, int(r["n_ctx_long"]))
  short = run(m, ids, int(r["n_ctx"]))
  assert int(r["n_ctx_long"]) > m.config.rope_original_context >= int(r["n_ctx"])
  assert rel_l2(long, r["f32_long_logits"], axis=-1).max() < 1e-5
  assert rel_l2(long, forward(*float64("phi3", "f32"), ids, n_ctx=512)) < 1e-5
  assert rel_l2(short, long) > 1e-2
  clear = clear_positions(r["q8_long_logits"])
  q8 = run(model("phi3", "q8_0"), r["q8_long_tokens"][:-1], int(r["n_ctx_long"]))
  agree = np.argmax(q8, -1) == np.argmax(r["q8_long_logits"], -1)
  assert clear.sum() >= len(q8) // 2 and agree[clear].all()


def test_llama31_rope_freqs_matter():
  """Without its rope_freqs the Llama 3.1 model is far from llama.cpp: the factors are read."""
  r, m = refs("llama31"), model("llama31", "f32")
  ids = r["f32_tokens"][:-1]
  params = dict(m.params, rope_freqs=jnp.ones_like(m.params["rope_freqs"]))
  out, _ = m.model.apply({"params": params}, jnp.asarray(ids)[None], m._cache(len(ids)), 0)
  assert rel_l2(np.asarray(out[0]), r["f32_logits"]) > 1e-3
