"""`load_gguf` on the `gemma4` arch against a float64 forward and llama.cpp's outputs.

The files (tests/data/gguf_models/tiny-gemma4-*-{f32,q8_0,q4_k_m}.gguf) and llama.cpp's logits,
greedy tokens, token ids and chat renderings on them (tiny-gemma4-*.npz, F32 KV cache, flash
attention off) are made by scripts/make_gguf_references.py (scripts/gguf_gemma4.py):

  gemma4-e2b   as E2B / E4B: per-layer embeddings, the last 3 of 6 layers sharing the KV of
               layers 1 (local) and 2 (global), FFN twice as wide there, one KV head;
  gemma4-31b   as 31B: KV heads per kind (2 local, 1 global), global layers with K as V;
  gemma4-moe   as 26B-A4B: 31B's attention on 4 layers, each with 8 experts (top 2) beside the
               dense FFN.

Both have head widths 16 (local) / 32 (global), a window of 8 (the sequences are 72 tokens:
the rings wrap), proportional rope on the global layers, `layer_output_scale`, Gemma 4's own
vocabulary (its first 640 tokens) and chat template.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from q8rules import Q8Provider, Q8Rule
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint.gguf import open_gguf
from q8rules.llm import GGUFModel, load_gguf
from q8rules.llm.config import config_from_metadata
from q8rules.llm.tensors import skipped_tensors, tensor_slots
from q8rules.models.transformer import Transformer, init_cache
from q8rules.q8_0 import Q8Array
from tests._utils import matrix
from tests.gemma4_numpy_forward import forward, load
from tests.gguf_numpy_forward import gelu_fp16_table

DATA = Path(__file__).parent / "data" / "gguf_models"
NAMES = ("gemma4-e2b", "gemma4-31b", "gemma4-moe")
F32_VS_LLAMA_CPP = 1e-3
"""Rel. L2 bound on the F32 files against llama.cpp, per position (measured 7.6e-4, 9.3e-4 and
6.4e-4; 3.8e-4, 4.6e-4 and 3.8e-4 over all logits): llama.cpp's CPU GELU reads a float16 table
(`test_gap_to_llama_cpp_is_its_float16_gelu`)."""


@functools.cache
def model(name: str, kind: str) -> GGUFModel:
  return load_gguf(DATA / f"tiny-{name}-{kind}.gguf", dtype=jnp.float32, progress=False)


@functools.cache
def refs(name: str) -> dict[str, np.ndarray]:
  with np.load(DATA / f"tiny-{name}.npz") as z:
    return {k: z[k] for k in z.files}


def rel_l2(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def run(m: GGUFModel, ids: np.ndarray, params=None) -> np.ndarray:
  """Logits (T, vocab) of one pass over ids with the context llama.cpp ran with."""
  variables = {"params": m.params if params is None else params}
  cache = init_cache(m.config, int(refs_of(m)["n_ctx"]))
  out, _ = m.model.apply(variables, jnp.asarray(ids, jnp.int32)[None], cache, 0)
  return np.asarray(out[0])


def refs_of(m: GGUFModel) -> dict[str, np.ndarray]:
  return refs(Path(m.path).name.rsplit("-", 1)[0].removeprefix("tiny-"))


EXPECTED = {
  "gemma4-e2b": dict(
    head_dim=32,
    head_dim_local=16,
    kv_heads=1,
    layer_kv_heads=(),
    layer_ffn=(64, 64, 64, 128, 128, 128),
    layer_k_as_v=(False,) * 6,
    shared_kv_layers=3,
    per_layer_dim=32,
  ),
  "gemma4-31b": dict(
    head_dim=32,
    head_dim_local=16,
    layer_kv_heads=(2, 2, 1, 2, 2, 1),
    layer_ffn=(),
    layer_k_as_v=(False, False, True, False, False, True),
    shared_kv_layers=0,
    per_layer_dim=0,
  ),
  "gemma4-moe": dict(
    layer_kv_heads=(2, 2, 1, 2),
    layer_k_as_v=(False, False, True, False),
    local_layers=(True, True, False, True),
    experts=8,
    experts_used=2,
    expert_ffn=32,
    ffn=64,
    expert_gating="softmax",
    expert_weights_norm=True,
    expert_fused_gate_up=True,
    expert_dense_branch=True,
    expert_router_norm=True,
    expert_down_scale=True,
  ),
}
COMMON = dict(
  local_layers=(True, True, False, True, True, False),
  sliding_window=8,
  rope_base=1e6,
  rope_base_local=1e4,
  rope_freq_factors=True,
  attn_scale=1.0,
  final_softcap=30.0,
  qk_norm=True,
  v_norm=True,
  post_norms=True,
  layer_out_scale=True,
  tied_embeddings=True,
  scan_layers=False,
)


@pytest.mark.parametrize("name", NAMES)
def test_config_from_metadata(name):
  c = model(name, "q8_0").config
  for field, want in {**COMMON, **EXPECTED[name]}.items():
    assert getattr(c, field) == want, (field, getattr(c, field), want)


def test_shared_layers_hold_no_kv():
  """E2B: the KV cache holds the 3 layers that compute KV (2 local rings of the window, 1
  global); the shared layers have no k / v params, and their k / v tensors in the file are
  skipped."""
  m = model("gemma4-e2b", "f32")
  c = m.config
  cache = init_cache(c, 64)
  assert cache["local"][0].shape == (2, 1, 8, 1, 16)
  assert cache["global"][0].shape == (1, 1, 64, 1, 32)
  assert c.cache_slots == (0, 1, 0, 1, 1, 0)
  assert [c.kv_source(i) for i in range(6)] == [0, 1, 2, 1, 1, 2]
  for i in range(6):
    attn = m.params[f"layers_{i}"]["attn"]
    assert ("k" in attn) == ("v" in attn) == (i < 3), (i, sorted(attn))
  skipped = skipped_tensors(c)
  assert "blk.4.attn_k.weight" in skipped and not skipped & set(tensor_slots(c))
  assert skipped <= set(m.source.tensors) | skipped
  assert not skipped & set(m.source.tensors)


@pytest.mark.parametrize("kind", ["q8_0", "f32"])
@pytest.mark.parametrize("name", matrix(NAMES, "gemma4-31b"))
def test_logits_match_float64(name, kind):
  """float32 activations within 1e-5 rel. L2 of a float64 forward of the file's weights,
  over prompt + 31 tokens (past the window)."""
  ids = refs(name)["f32_tokens"][:-1]
  ours = model(name, kind).logits(ids)
  ref = forward(*load(DATA / f"tiny-{name}-{kind}.gguf"), ids)
  assert rel_l2(ours, ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_f32_logits_match_llama_cpp(name):
  """On the F32 file, every position within 1e-3 of llama.cpp's logits (same context)."""
  r = refs(name)
  ours = run(model(name, "f32"), r["f32_tokens"][:-1])
  err = rel_l2(ours, r["f32_logits"], axis=-1)
  assert err.shape == (len(r["f32_tokens"]) - 1,)
  assert err.max() < F32_VS_LLAMA_CPP, err.max()


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix(NAMES, "gemma4-31b"))
def test_gap_to_llama_cpp_is_its_float16_gelu(name):
  """The gap to llama.cpp is its CPU GELU's float16 table: with every GELU's input zeroed
  (ffn_gate, inp_gate, the experts' gate rows) we are within 1e-5 of llama.cpp at every
  position, and the float64 forward with the table emulated comes closer to llama.cpp than
  exact (measured 3.7e-4 against 7.6e-4, 2.8e-4 against 9.3e-4, 4.1e-4 against 6.4e-4: not to
  1e-5, as near a float16 rounding boundary a difference of 1e-7 in a GELU's input flips its
  table entry)."""
  r, m = refs(name), model(name, "f32")
  ids = r["f32_tokens"][:-1]

  def zero_gates(path, leaf):  # the dense FFN's, the per-layer branch's, the experts' gates
    keys = [getattr(p, "key", None) for p in path]
    if "gate_up_exps" in keys:  # (E, dim, 2F): gate columns first
      return leaf.at[..., : m.config.expert_ffn].set(0)
    return jnp.zeros_like(leaf) if "gate" in keys else leaf

  params = jax.tree_util.tree_map_with_path(zero_gates, m.params)
  assert rel_l2(run(m, ids, params), r["f32_no_gelu_logits"], axis=-1).max() < 1e-5
  hp, w = load(DATA / f"tiny-{name}-f32.gguf")
  exact = rel_l2(forward(hp, w, ids), r["f32_logits"], axis=-1).max()
  table = rel_l2(forward(hp, w, ids, gelu=gelu_fp16_table), r["f32_logits"], axis=-1).max()
  assert 1e-5 < exact < F32_VS_LLAMA_CPP and table < exact, (exact, table)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_q8_0_no_farther_from_f32_than_llama_cpp(name):
  """Our Q8_0 logits are no farther from our F32 file's than llama.cpp's Q8_0 run is from its
  F32 run (it also rounds the activations to Q8_0), on the same tokens."""
  r = refs(name)
  ids = r["f32_tokens"][:-1]
  ours = rel_l2(run(model(name, "q8_0"), ids), run(model(name, "f32"), ids))
  theirs = rel_l2(r["q8_on_f32_logits"], r["f32_logits"])
  print(f"{name} Q8_0 vs F32: ours {ours:.2e}, llama.cpp's {theirs:.2e}")
  assert ours <= theirs, (ours, theirs)


@pytest.mark.parametrize("name", matrix(NAMES, "gemma4-31b"))
def test_q4_k_m_loads_requantized(name):
  """llama.cpp's own Q4_K_M file loads with no flag (its other types requantized to Q8_0), its
  logits as far from the F32 file's as llama.cpp's own Q4_K_M run is from its F32 run, within
  10 %, printed beside it."""
  r, m = refs(name), model(name, "q4_k_m")
  assert sum(m.requantized.values()) > 0
  ids = r["f32_tokens"][:-1]
  ours = rel_l2(run(m, ids), run(model(name, "f32"), ids))
  theirs = rel_l2(r["q4_k_m_on_f32_logits"], r["f32_logits"])
  print(
    f"{name} Q4_K_M vs F32: ours (requantized {dict(m.requantized)}) {ours:.3e},"
    f" llama.cpp's {theirs:.3e}"
  )
  assert ours < 1.1 * theirs, (ours, theirs)


@pytest.mark.parametrize("kind", [pytest.param("q8_0", marks=pytest.mark.slow), "f32"])
@pytest.mark.parametrize("name", matrix(NAMES, "gemma4-e2b"))
def test_decode_equals_full_pass(name, kind):
  """Prefill 3 tokens, then one token a step far past the window (and with the shared layers
  reading the KV of earlier ones): the one-pass logits."""
  m = model(name, kind)
  ids = refs(name)["f32_tokens"][:-1]
  full = m.logits(ids)
  cache = m._cache(len(ids))
  out, cache = m._run(jnp.asarray(ids[:3], jnp.int32)[None], cache, 0)
  steps = [np.asarray(out[0])]
  for i in range(3, len(ids)):
    out, cache = m._run(jnp.asarray([[ids[i]]], jnp.int32), cache, i)
    steps.append(np.asarray(out[0]))
  assert rel_l2(np.concatenate(steps), full) < 1e-5


@pytest.mark.parametrize("name", matrix(NAMES, "gemma4-e2b"))
def test_generate_equals_llama_cpp(name):
  """Greedy `generate` on the F32 file: llama.cpp's 32 tokens."""
  r = refs(name)
  prompt = r["prompt_ids"]
  new = model(name, "f32").generate(prompt, 32)
  assert new == r["f32_tokens"][len(prompt) :].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_token_ids_equal_llama_cpp(name):
  """Gemma 4's tokenizer (model 'gemma4', cut to 640 tokens): llama.cpp's ids of each string and
  of a text of 100+ tokens."""
  r, tok = refs(name), model(name, "f32").tokenizer
  ids, offsets = r["tok_ids"], r["tok_offsets"]
  assert offsets[-1] - offsets[-2] >= 100
  for i, s in enumerate(r["tok_strings"]):
    assert tok.encode(str(s), add_special=False) == ids[offsets[i] : offsets[i + 1]].tolist(), s
  assert tok.encode("Hi")[0] == tok.bos_id == 2


def test_chat_template_renders_as_llama_cpp_python():
  """Gemma 4's chat template (the file's): llama-cpp-python's text and ids."""
  r, m = refs("gemma4-e2b"), model("gemma4-e2b", "f32")
  conversations = json.loads(str(r["chat_messages"]))
  assert len(conversations) == len(r["chat_names"]) >= 2
  for i, messages in enumerate(conversations):
    text = m.apply_chat_template(messages, tokenize=False)
    assert text == str(r["chat_texts"][i])
    ids = r["chat_ids"][r["chat_offsets"][i] : r["chat_offsets"][i + 1]].tolist()
    assert m.apply_chat_template(messages) == ids


def test_rules_keep_per_layer_model_proj_float():
  """The E2B-shaped model under one plain `Q8Rule()`: every matrix served as Q8_0 (the tables'
  lookups included) but the per-layer model projection, which the report lists float with
  llama.cpp's reason."""
  c = model("gemma4-e2b", "f32").config
  ids = jnp.asarray(refs("gemma4-e2b")["f32_tokens"][None, :12])
  provider = Q8Provider([Q8Rule()])
  q8 = qwix.quantize_model(Transformer(c), provider)
  jax.eval_shape(q8.init, jax.random.key(0), ids, init_cache(c, 16), 0)  # traced: the report
  report = provider.report()
  floats = {f.path: f.reason for f in report.float_params}
  assert list(floats) == ["per_layer/per_layer_model_proj/kernel"], floats
  assert "per_layer_model_proj" in floats["per_layer/per_layer_model_proj/kernel"]
  served = {op.module for op in report.ops if op.q8_bytes}
  assert {"embed", "per_layer", "layers_0/ple/gate", "layers_5/ple/proj"} <= served, served
  assert {f"layers_{i}/attn/{p}" for i in (3, 4, 5) for p in "qo"} <= served
  assert not any("per_layer_model_proj" in m for m in served)


def test_experts_are_q8_0_stacks_and_the_router_float():
  """The 26B-A4B-shaped Q8_0 file: each layer's fused gate|up and down expert stacks are Q8_0
  stacks (E, K, N) as stored, the router and its scales float; under a plain `Q8Rule()` the
  report lists the router float with llama.cpp's reason and serves the stacks."""
  m = model("gemma4-moe", "q8_0")
  moe = m.params["layers_0"]["moe"]
  stack = moe["gate_up_exps"]
  stack = stack.array if hasattr(stack, "array") else stack
  assert isinstance(stack, Q8Array) and stack.q.shape == (8, 64, 64), stack
  assert moe["gate_inp"]["kernel"].dtype == jnp.float32
  assert moe["down_exps_scale"].shape == (8,) and moe["gate_inp_scale"].shape == (64,)
  c = m.config
  ids = jnp.asarray(refs("gemma4-moe")["f32_tokens"][None, :12])
  provider = Q8Provider([Q8Rule()])
  q8 = qwix.quantize_model(Transformer(c), provider)
  jax.eval_shape(q8.init, jax.random.key(0), ids, init_cache(c, 16), 0)  # traced: the report
  report = provider.report()
  floats = {f.path: f.reason for f in report.float_params}
  assert sorted(floats) == [f"layers_{i}/moe/gate_inp/kernel" for i in range(4)], floats
  assert all("ffn_gate_inp" in r for r in floats.values())
  served = {op.module for op in report.ops if op.q8_bytes}
  assert {"layers_3/moe", "layers_3/mlp/gate"} <= served, served


def test_real_26b_a4b_metadata():
  """The header of llama.cpp's ggml-vocab-gemma-4.gguf (Gemma 4 26B-A4B's real metadata, no
  tensors) with the tensor names its converter writes: the model llama.cpp builds."""
  from tests.test_tokenizer_suite import vocab_dir

  with open_gguf(vocab_dir() / "ggml-vocab-gemma-4.gguf") as f:
    meta = f.metadata
  names = {f"blk.{i}.{n}" for i in range(30) for n in ("ffn_gate_up_exps.weight", "attn_v.weight")}
  names = {n for n in names if not (n.endswith("attn_v.weight") and int(n.split(".")[1]) % 6 == 5)}
  names |= {f"blk.{i}.{n}" for i in range(30) for n in ("layer_output_scale.weight",)}
  names |= {f"blk.{i}.ffn_down_exps.scale" for i in range(30)}
  c = config_from_metadata(meta, path="26b.gguf", vocab=262144, tensors=names)
  assert (c.dim, c.layers, c.heads, c.head_dim, c.head_dim_local) == (2816, 30, 16, 512, 256)
  assert c.layer_kv_heads == (8, 8, 8, 8, 8, 2) * 5 and c.sliding_window == 1024
  assert c.layer_k_as_v == ((False,) * 5 + (True,)) * 5
  assert (c.experts, c.experts_used, c.expert_ffn, c.ffn) == (128, 8, 704, 2112)
  assert c.expert_fused_gate_up and c.expert_down_scale and c.final_softcap == 30.0
  assert init_cache(c, 4096)["local"][0].shape == (25, 1, 1024, 8, 256)
  assert init_cache(c, 4096)["global"][0].shape == (5, 1, 4096, 2, 512)


def _meta(**changes) -> dict:
  """The E2B file's metadata with `changes` (None: the key removed)."""
  meta = dict(model("gemma4-e2b", "f32").metadata)
  for key, value in changes.items():
    key = "gemma4." + key.replace("__", ".")
    if value is None:
      meta.pop(key)
    else:
      meta[key] = value
  return meta


def _config(meta: dict):
  shapes = model("gemma4-e2b", "f32").source.tensors
  return config_from_metadata(meta, path="f.gguf", vocab=640, tensors=shapes)


@pytest.mark.parametrize(
  ("changes", "message"),
  [
    (dict(attention__sliding_window_pattern=None), "gemma4.attention.sliding_window_pattern"),
    (dict(attention__sliding_window_pattern=[True, False]), "one bool per layer"),
    (dict(attention__key_length_swa=None), "gemma4.attention.key_length_swa"),
    (dict(embedding_length_per_layer_input=None), "embedding_length_per_layer_input"),
    (dict(attention__shared_kv_layers=5), "gemma4.attention.shared_kv_layers 5"),
    (dict(attention__shared_kv_layers=2), "another kind"),
    (dict(attention__head_count=[2] * 6), "per-layer values of 'gemma4.attention.head_count'"),
    (dict(attention__head_count_kv=[1, 2, 1, 1, 1, 1]), "gemma4.attention.head_count_kv"),
    (dict(feed_forward_length=[64] * 5), "gemma4.feed_forward_length has 5 entries"),
    (dict(rope__dimension_count_swa=8), "gemma4.rope.dimension_count_swa 8"),
    (dict(expert_count=4, expert_used_count=5), "gemma4.expert_used_count 5 must be in"),
    (dict(expert_count=4, expert_used_count=2), "gemma4.expert_feed_forward_length"),
  ],
)
def test_bad_metadata_names_the_key(changes, message):
  with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
    _config(_meta(**changes))


def test_defaults_of_absent_keys():
  """llama.cpp's defaults: final soft-capping 30, the local base 10000, no shared layers."""
  c = _config(_meta(final_logit_softcapping=None, rope__freq_base_swa=None))
  assert (c.final_softcap, c.rope_base_local) == (30.0, 10000.0)
  c = _config(_meta(attention__shared_kv_layers=None))
  assert c.shared_kv_layers == 0 and c.kv_layers == 6


@pytest.mark.parametrize("name", NAMES)
def test_file_params_is_the_traced_tree(name):
  """The param tree `load_gguf` builds from the Q8_0 file's specs alone is the traced one
  (`jax.eval_shape` of the quantized model's init), unrolled layers of their own widths."""
  from tests.test_param_specs import assert_same_tree, both_trees

  got, want, plan = both_trees(DATA / f"tiny-{name}-q8_0.gguf", dtype=jnp.float32, fuse=True)
  assert not plan.config.scan_layers and "layers_0" in got
  assert_same_tree(got, want)


@pytest.mark.parametrize("name", ["gemma4-e2b", "gemma4-moe"])
def test_save_gguf_round_trip_is_the_identity(tmp_path, name):
  """`save_gguf` of a loaded Q8_0 file writes it back tensor for tensor, the expert stacks and
  the shared layers' k / v the model does not read included."""
  from tests.test_save_gguf import read

  src = DATA / f"tiny-{name}-q8_0.gguf"
  out = tmp_path / "out.gguf"
  model(name, "q8_0").save_gguf(out)
  assert read(out) == read(src)
