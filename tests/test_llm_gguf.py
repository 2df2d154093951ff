"""`load_gguf` on the committed tiny llama / qwen2 GGUF files, against float64 and llama.cpp.

The files and llama.cpp's outputs on them are made by
`scripts/make_gguf_references.py` (tests/data/gguf_models/); nothing here runs
llama.cpp unless `llama_cpp` imports (then one live check runs).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import q8rules
from q8rules.checkpoint import gguf as ckpt_gguf
from q8rules.llm import GGUFModel, load_gguf
from tests._utils import matrix
from tests.gguf_numpy_forward import forward, load_float64

DATA = Path(__file__).parent / "data" / "gguf_models"
ARCHS = ("llama", "qwen2")


@functools.cache
def model(arch: str, kind: str, fuse: bool = True) -> GGUFModel:
  """The committed tiny model, float32 activations (loaded once per session)."""
  return load_gguf(DATA / f"tiny-{arch}-{kind}.gguf", dtype=jnp.float32, fuse=fuse)


@functools.cache
def refs(arch: str) -> dict[str, np.ndarray]:
  with np.load(DATA / f"tiny-{arch}.npz") as z:
    return {k: z[k] for k in z.files}


def rel_l2(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_from_metadata(arch):
  c = model(arch, "q8_0").config
  assert (c.arch, c.layers, c.dim, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab) == (
    arch,
    2,
    128,
    4,
    2,
    32,
    256,
    384,
  )
  assert c.tied_embeddings == (arch == "qwen2") and c.qkv_bias == (arch == "qwen2")
  assert c.rope_style == ("interleaved" if arch == "llama" else "halves")
  assert c.rope_base == (10000.0 if arch == "llama" else 1e6)
  assert c.norm_eps == pytest.approx(1e-5 if arch == "llama" else 1e-6)
  assert c.context_length == 256 and c.rope_scaling is None


@pytest.mark.parametrize("arch", ARCHS)
def test_params_keep_the_files_tensors(arch):
  """Every Q8_0 tensor is a Q8Array with the file's int8 values and float16 scales; floats as
  stored (loaded unfused: one param per file tensor; the fused params are the next test's)."""
  m = model(arch, "q8_0", fuse=False)
  assert not m.config.fused_qkv and not m.config.fused_gate_up
  flat = q8rules.checkpoint.assign.flatten(m.params)
  with ckpt_gguf.load(DATA / f"tiny-{arch}-q8_0.gguf") as ckpt:
    from q8rules.llm.tensors import tensor_slots

    for name, slot in tensor_slots(m.config).items():
      got, want = flat[".".join(slot.path)], ckpt[name]
      if m.config.scan_layers and slot.layer is not None:  # stacked along the layer axis
        got = jax.tree.map(lambda a, i=slot.layer: a[i], got)
      if ckpt.tensor_type(name) == T.Q8_0:
        assert isinstance(got, q8rules.Q8Array), name
        assert np.asarray(got.q).dtype == np.int8 and np.asarray(got.scale).dtype == np.float16
        np.testing.assert_array_equal(np.asarray(got.q), want.q)
        np.testing.assert_array_equal(np.asarray(got.scale), want.scale)
      else:
        assert np.asarray(got).dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("kind", ["q8_0", "f32"])
@pytest.mark.parametrize("arch", matrix(ARCHS, "llama"))
def test_fused_params_concatenate_the_files_tensors(arch, kind):
  """`fuse=True` (the default) gives each layer one q | k | v and one gate | up matrix: the
  unfused params (the file's tensors) concatenated along the output axis, Q8_0 values and
  scales as they are (qwen2's q, k, v biases too); the logits are the unfused model's."""
  fused, apart = model(arch, kind), model(arch, kind, fuse=False)
  assert fused.config.fused_qkv and fused.config.fused_gate_up
  f = fused.params["layers"]
  a = apart.params["layers"]

  def values(p):  # a Q8 weight's Q8Array (its metadata names the param), or the array
    return getattr(p, "array", p)

  def concat(*parts):
    parts = [values(p) for p in parts]
    return jax.tree.map(lambda *x: np.concatenate([np.asarray(v) for v in x], axis=-1), *parts)

  def same(got, want):
    got, want = jax.tree.leaves(values(got)), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
      assert np.asarray(g).dtype == w.dtype
      np.testing.assert_array_equal(np.asarray(g), w)

  leaves = ("kernel", "bias") if fused.config.qkv_bias else ("kernel",)
  for leaf in leaves:
    same(f["attn"]["qkv"][leaf], concat(*(a["attn"][n][leaf] for n in ("q", "k", "v"))))
  same(f["mlp"]["up"]["kernel"], concat(a["mlp"]["gate"]["kernel"], a["mlp"]["up"]["kernel"]))
  assert "gate" not in f["mlp"] and not {"q", "k", "v"} & set(f["attn"])
  ids = refs(arch)["q8_tokens"]
  assert rel_l2(fused.logits(ids), apart.logits(ids)) < 1e-6


@pytest.mark.parametrize("kind", ["q8_0", "f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_float64(arch, kind):
  """float32 activations within 1e-5 relative L2 of a float64 forward of the file's weights
  (written HF's way: llama's q/k rows un-permuted, rotate-half rope)."""
  ids = refs(arch)["q8_tokens"]
  ours = model(arch, kind).logits(ids)
  assert ours.shape == (len(ids), 384) and ours.dtype == np.float32
  ref = forward(*load_float64(DATA / f"tiny-{arch}-{kind}.gguf"), ids)
  assert rel_l2(ours, ref) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_llama_cpp(arch):
  """On the F32 file, within 1.5e-3 relative L2 of llama.cpp's logits at every position."""
  r = refs(arch)
  ours = model(arch, "f32").logits(r["f32_tokens"][:-1])
  err = rel_l2(ours, r["f32_logits"], axis=-1)
  assert err.shape == (len(r["f32_tokens"]) - 1,)
  assert err.max() < 1.5e-3, err


def margin_agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[int, int]:
  """(positions where llama.cpp's top-1 beats its top-2 by > 0.05 std, of those where argmaxes agree)."""
  top2 = np.sort(theirs, axis=-1)[:, -2:]
  clear = (top2[:, 1] - top2[:, 0]) > 0.05 * theirs.std(axis=-1)
  agree = np.argmax(ours, -1) == np.argmax(theirs, -1)
  return int(clear.sum()), int((clear & agree).sum())


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_argmax_matches_llama_cpp(arch):
  """On the Q8_0 file (llama.cpp also quantizes activations to Q8_0 there): our argmax equals
  llama.cpp's wherever its top-1 clearly beats its top-2, over prompt + 32 greedy tokens."""
  r = refs(arch)
  ours = model(arch, "q8_0").logits(r["q8_tokens"][:-1])
  clear, agree = margin_agreement(ours, r["q8_logits"])
  assert clear >= len(ours) // 2
  assert agree == clear, f"{agree}/{clear}"


@pytest.mark.parametrize("kind", ["q8_0", "f32"])
@pytest.mark.parametrize("arch", matrix(ARCHS, "qwen2"))
def test_generate_greedy_with_kv_cache(arch, kind):
  """`generate` (prefill, then one token a step on the KV cache) picks the argmax of the
  full-sequence logits at every step, and follows llama.cpp's greedy continuation
  wherever llama.cpp's choice was clear."""
  r = refs(arch)
  prompt = r["prompt_ids"]
  new = model(arch, kind).generate(prompt, 32)
  assert len(new) == 32
  seq = np.concatenate([prompt, new])
  full = model(arch, kind).logits(seq[:-1])
  np.testing.assert_array_equal(np.argmax(full[len(prompt) - 1 :], -1), new)
  theirs_tokens, theirs_logits = r[f"{kind[:3] if kind == 'f32' else 'q8'}_tokens"], None
  theirs_logits = r["f32_logits" if kind == "f32" else "q8_logits"]
  top2 = np.sort(theirs_logits, -1)[:, -2:]
  clear = (top2[:, 1] - top2[:, 0]) > 0.05 * theirs_logits.std(-1)
  for i, tok in enumerate(new):  # same tokens up to the first unclear choice of llama.cpp
    pos = len(prompt) - 1 + i
    if not clear[pos]:
      break
    assert tok == theirs_tokens[pos + 1], (i, new, theirs_tokens[len(prompt) :])


def test_kv_cache_decode_equals_full_pass():
  """Logits from the cache, one token at a time, equal the one-pass logits (float32)."""
  m = model("llama", "q8_0")
  ids = refs("llama")["q8_tokens"][:12]
  full = m.logits(ids)
  cache = m._cache(len(ids))
  steps = []
  for i, tok in enumerate(ids):
    out, cache = m._run(jnp.asarray([[tok]], jnp.int32), cache, i)
    steps.append(np.asarray(out[0, 0]))
  assert rel_l2(np.stack(steps), full) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_llama_cpp(arch):
  r = refs(arch)
  tok = model(arch, "q8_0").tokenizer
  for i, s in enumerate(r["tok_strings"]):
    want = r["tok_ids"][r["tok_offsets"][i] : r["tok_offsets"][i + 1]].tolist()
    got = tok.encode(str(s))
    assert got == want, (s, got, want)
    assert tok.decode(got) == str(s)
  assert tok.encode(str(r["prompt"])) == r["prompt_ids"].tolist()


def test_bfloat16_activations_run():
  m = load_gguf(DATA / "tiny-llama-q8_0.gguf")  # default dtype bfloat16
  ids = refs("llama")["q8_tokens"][:-1]
  ours = m.logits(ids)
  assert ours.dtype == np.float32 and rel_l2(ours, model("llama", "q8_0").logits(ids)) < 0.05


def test_llama_cpp_live():
  """When llama-cpp-python is installed: its logits on the F32 file, computed now."""
  llama_cpp = pytest.importorskip("llama_cpp")
  r = refs("llama")
  llm = llama_cpp.Llama(
    str(DATA / "tiny-llama-f32.gguf"), n_ctx=64, logits_all=True, type_k=0, type_v=0, verbose=False
  )
  ids = r["f32_tokens"][:-1].tolist()
  llm.eval(ids)
  theirs = np.array(llm.scores[: len(ids)], np.float32)
  assert rel_l2(model("llama", "f32").logits(ids), theirs, axis=-1).max() < 1.5e-3
