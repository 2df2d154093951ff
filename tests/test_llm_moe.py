"""`load_gguf` on mixture-of-experts files: `qwen3moe` and Mixtral-style `llama` files with
`ffn_*_exps`, against llama.cpp and a float64 forward.

The tiny files (tests/data/gguf_models/tiny-{qwen3moe,mixtral}-*.gguf: F32, Q8_0 and llama.cpp's
own Q4_K_M) and llama.cpp's outputs on them are made by scripts/gguf_moe.py: 8 experts, top 2,
38 positions (prompt + greedy), so every expert gets rows.

The Q8_0 comparison with llama.cpp runs on the positions whose routing is clear: where, in every
layer, the F32 model's 2nd expert beats its 3rd by more than `CLEAR_MARGIN` in probability. A
quantized run (ours or llama.cpp's, which also quantizes the activations) may swap two experts
whose probabilities are closer than its rounding, and that position's logits then jump by tens
of percent in either run, at positions that differ between the two.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from gguf import GGUFValueType as V
from jax.sharding import AxisType

import q8rules
from q8rules.checkpoint import CheckpointError
from q8rules.kernels.ragged_matmul import api as ragged_api
from q8rules.llm import GGUFModel, load_gguf
from q8rules.models.transformer import Transformer, init_cache
from q8rules.providers.q8_weight import Q8Weight
from tests._utils import matrix
from tests.gguf_numpy_forward import forward, load_float64
from tests.test_llm_gguf_errors import rewrite

DATA = Path(__file__).parent / "data" / "gguf_models"
NAMES = ("qwen3moe", "mixtral")
CLEAR_MARGIN = 0.02

EXPECTED = {
  "qwen3moe": dict(
    arch="qwen3moe", experts=8, experts_used=2, expert_ffn=32, ffn=96, head_dim=32, qk_norm=True
  ),
  "mixtral": dict(arch="llama", experts=8, experts_used=2, expert_ffn=64, ffn=64, head_dim=16),
}


@functools.cache
def model(name: str, kind: str) -> GGUFModel:
  return load_gguf(DATA / f"tiny-{name}-{kind}.gguf", dtype=jnp.float32, progress=False)


@functools.cache
def refs(name: str) -> dict[str, np.ndarray]:
  with np.load(DATA / f"tiny-{name}.npz") as z:
    return {k: z[k] for k in z.files}


@functools.cache
def float64(name: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
  """The float64 forward's logits of the file on the F32 run's tokens, and the routing margin
  (T,): the smallest, over the layers, of the 2nd expert's probability minus the 3rd's."""
  hp, w = load_float64(DATA / f"tiny-{name}-{kind}.gguf")
  routes: list[np.ndarray] = []
  logits = forward(hp, w, refs(name)["f32_tokens"][:-1], routes=routes)
  k = hp["experts_used"]
  margins = [np.sort(p, -1)[:, -k] - np.sort(p, -1)[:, -k - 1] for p in routes]
  return logits, np.min(margins, axis=0)


def rel_l2(a, b, axis=None) -> np.ndarray:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def on_f32_tokens(m: GGUFModel, name: str) -> np.ndarray:
  return m.logits(refs(name)["f32_tokens"][:-1])


@pytest.mark.parametrize("name", NAMES)
def test_config_from_metadata(name):
  c = model(name, "q8_0").config
  for field, want in EXPECTED[name].items():
    assert getattr(c, field) == want, field
  assert c.expert_gating == "softmax" and c.expert_weights_norm and c.scan_layers


@pytest.mark.parametrize("name", NAMES)
def test_token_ids_are_llama_cpps(name):
  """The tokenizer strings and a 100+ token text, as llama.cpp tokenizes them."""
  r, tok = refs(name), model(name, "f32").tokenizer
  offsets = r["tok_offsets"]
  assert offsets[-1] - offsets[-2] >= 100
  for i, text in enumerate(r["tok_strings"]):
    want = r["tok_ids"][offsets[i] : offsets[i + 1]].tolist()
    assert tok.encode(str(text)) == want, text


@pytest.mark.parametrize("name", matrix(NAMES, "mixtral"))
def test_f32_logits_match_llama_cpp_and_float64(name):
  """Per-position rel. L2 within 1e-5 of llama.cpp (measured 7e-7 and 1.1e-6); the float64
  forward (HF's sparse MoE block) within 1e-6 of llama.cpp's too."""
  r = refs(name)
  ours = on_f32_tokens(model(name, "f32"), name)
  assert rel_l2(ours, r["f32_logits"], axis=-1).max() < 1e-5
  ref64, _ = float64(name, "f32")
  assert rel_l2(ref64, r["f32_logits"]) < 2e-6
  assert rel_l2(ours, ref64) < 2e-6


@pytest.mark.parametrize("name", matrix(NAMES, "mixtral"))
def test_q8_0_is_its_float64_and_no_farther_from_f32_than_llama_cpp(name):
  """Our Q8_0 run is the float64 forward of the file's Q8_0 values; on the clearly routed
  positions it is no farther from the F32 model's logits than llama.cpp's own Q8_0 run."""
  r = refs(name)
  ours = on_f32_tokens(model(name, "q8_0"), name)
  q8_64, _ = float64(name, "q8_0")
  assert rel_l2(ours, q8_64, axis=-1).max() < 1e-5
  _, margin = float64(name, "f32")
  clear = margin > CLEAR_MARGIN
  assert clear.sum() >= 15, clear.sum()
  mine = rel_l2(ours[clear], r["f32_logits"][clear])
  theirs = rel_l2(r["q8_on_f32_logits"][clear], r["f32_logits"][clear])
  assert mine <= theirs, (mine, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_q8_0_activations_give_llama_cpps_own_q8_0_logits(name):
  """With `act_qtype='q8_0'` every product, the grouped experts' included, quantizes its
  activations as llama.cpp does for Q8_0 weights: on the clearly routed positions the logits
  are llama.cpp's Q8_0 run's to float32 rounding, where the weight-only default differs by the
  activations' rounding (and is closer to the F32 model). A float32 sum taken in another order
  can move one activation across a rounding boundary and every later position with it (about
  1 % in these 64-wide models), so the test asks most positions, not all, to agree."""
  r = refs(name)
  m = load_gguf(DATA / f"tiny-{name}-q8_0.gguf", dtype=jnp.float32, progress=False,
                act_qtype="q8_0")  # fmt: skip
  ours = on_f32_tokens(m, name)
  _, margin = float64(name, "f32")
  clear = margin > CLEAR_MARGIN
  theirs = r["q8_on_f32_logits"][clear]
  assert np.mean(rel_l2(ours[clear], theirs, axis=-1) < 1e-6) >= 0.8
  provider, model_ = served(m)
  ids = jnp.asarray(r["f32_tokens"][:8], jnp.int32)[None]
  jax.eval_shape(lambda t: model_.apply({"params": m.params}, t, init_cache(m.config, 8), 0), ids)
  paths = {op.path for op in provider.report().ops if op.op.startswith("ragged_dot")}
  order = ragged_api.DEFAULT_ORDER[jax.default_backend()]
  assert paths and all(p.endswith(" (act q8_0)") and p.split()[0] in order for p in paths), paths
  plain = on_f32_tokens(model(name, "q8_0"), name)
  assert np.mean(rel_l2(plain[clear], theirs, axis=-1) < 1e-6) == 0


@pytest.mark.parametrize("name", matrix(NAMES, "qwen3moe"))
def test_q4_k_m_loads_requantized_beside_llama_cpps_error(name):
  """llama.cpp's Q4_K_M file (its fallbacks Q5_0, Q5_1, Q8_0 at these widths) loads with no
  flag, the expert stacks requantized to Q8_0; its error against the F32 model, on the
  clearly routed positions, is within 1.25x of llama.cpp's own run of the file."""
  r, m = refs(name), model(name, "q4_k_m")
  assert sum(m.requantized.values()) > 0, m.requantized
  assert isinstance(m.params["layers"]["moe"]["gate_up_exps"], Q8Weight)
  _, margin = float64(name, "f32")
  clear = margin > CLEAR_MARGIN
  mine = rel_l2(on_f32_tokens(m, name)[clear], r["f32_logits"][clear])
  theirs = rel_l2(r["q4_k_m_on_f32_logits"][clear], r["f32_logits"][clear])
  assert mine <= 1.25 * theirs, (mine, theirs)


@pytest.mark.parametrize("name", matrix(NAMES, "mixtral"))
def test_greedy_32_tokens_are_llama_cpps(name):
  r, m = refs(name), model(name, "f32")
  prompt = r["prompt_ids"]
  new = m.generate(prompt, 32)
  np.testing.assert_array_equal(new, r["f32_tokens"][len(prompt) :])


@functools.cache
def unfused(name: str) -> GGUFModel:
  return load_gguf(DATA / f"tiny-{name}-q8_0.gguf", dtype=jnp.float32, fuse=False, progress=False)


@pytest.mark.parametrize("name", matrix(NAMES, "mixtral"))
def test_fused_gate_up_experts_are_the_file_values(name):
  """The gate | up stack fused at load holds the file's Q8_0 values and scales as they are
  (each expert's gate columns, then its up columns), so the logits are the unfused model's."""
  fused, plain = model(name, "q8_0"), unfused(name)
  both = fused.params["layers"]["moe"]["gate_up_exps"].array
  parts = [plain.params["layers"]["moe"][k].array for k in ("gate_exps", "up_exps")]
  for a in ("q", "scale"):
    np.testing.assert_array_equal(
      getattr(both, a), np.concatenate([getattr(p, a) for p in parts], -1)
    )
  ids = refs(name)["prompt_ids"]
  assert rel_l2(fused.logits(ids), plain.logits(ids)) < 1e-6


def served(m: GGUFModel) -> tuple[q8rules.Q8Provider, Any]:
  """The loaded model's rule on a fresh provider (its report is ours to read), and the model."""
  provider = q8rules.Q8Provider([m.rule])
  return provider, qwix.quantize_model(Transformer(m.config), provider)


@pytest.mark.parametrize("fuse", matrix([True, False], True))
@pytest.mark.parametrize("name", NAMES)
def test_every_expert_weight_is_served_as_q8_0_and_a_decode_step_is_grouped(name, fuse):
  """Each layer stack of experts is a Q8_0 param (L, E, K, N), never float (gate | up fused along
  N at load by default: one grouped product for both), and nothing under the rule's modules is
  left float; the router stays float; a one-token decode step runs the experts through the
  grouped product (the native CPU kernel) and continues the prefill as one pass does."""
  m = model(name, "q8_0") if fuse else unfused(name)
  moe = m.params["layers"]["moe"]
  c = m.config
  f = c.expert_ffn
  assert c.expert_fused_gate_up == fuse
  stacks = [("gate_up_exps", (c.dim, 2 * f))] if fuse else [("gate_exps", (c.dim, f))]
  stacks += [] if fuse else [("up_exps", (c.dim, f))]
  for stack, (k, n) in (*stacks, ("down_exps", (f, c.dim))):
    w = moe[stack]
    assert isinstance(w, Q8Weight) and w.array.q.dtype == jnp.int8, stack
    assert w.array.q.shape == (c.layers, c.experts, k, n), stack
  assert not isinstance(moe["gate_inp"]["kernel"], Q8Weight)
  provider, model_ = served(m)
  ids = jnp.asarray(refs(name)["f32_tokens"][:-1], jnp.int32)[None]
  cache = init_cache(c, 64)
  step = jax.jit(lambda t, cache, pos: model_.apply({"params": m.params}, t, cache, pos))
  full, _ = step(ids, cache, 0)
  _, filled = step(ids[:, :-1], cache, 0)
  last, _ = step(ids[:, -1:], filled, ids.shape[1] - 1)
  assert rel_l2(last[0, 0], full[0, -1]) < 1e-5
  report = provider.report()
  grouped = [r for r in report.ops if r.op.startswith("ragged_dot")]
  assert len(grouped) == 3 - fuse and {r.m for r in grouped} == {c.experts_used}, report
  assert all(r.path == "cpu" for r in grouped), report
  assert report.float_params == []  # the rule matches the served modules; the router is apart


@pytest.mark.parametrize("name", matrix(NAMES, "qwen3moe"))
def test_save_gguf_writes_the_experts_back(tmp_path, name):
  """save_gguf of a loaded Q8_0 MoE model is the source file, byte for byte."""
  src = DATA / f"tiny-{name}-q8_0.gguf"
  out = model(name, "q8_0").save_gguf(tmp_path / "out.gguf")
  assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("act_qtype", [None, "q8_0"])
@pytest.mark.parametrize("axis_type", matrix([AxisType.Auto, AxisType.Explicit], AxisType.Explicit))
def test_experts_split_over_a_mesh(axis_type, act_qtype):
  """On a 2-device mesh the expert stacks are split along E (whole experts per device) and the
  logits are the single-device model's, with Q8_0 activations too. The single-device model is
  loaded as the mesh loads it (gate and up apart: `fuse=False`): with Q8_0 activations a sum
  taken in another order (1e-7 apart) can move one activation across a rounding boundary of
  its block, and in this 64-wide model one such step at one position moves every later
  position's logits by about 1 %."""
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs 2 devices; the {jax.default_backend()} backend has {len(devices)}")
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(axis_type,), devices=devices[:2])
  path = DATA / "tiny-qwen3moe-q8_0.gguf"
  m = load_gguf(path, dtype=jnp.float32, mesh=mesh, progress=False, act_qtype=act_qtype)
  w = m.params["layers"]["moe"]["down_exps"].array
  assert tuple(w.q.sharding.spec)[:2] == (None, "tp")
  ids = refs("qwen3moe")["prompt_ids"]
  one = load_gguf(path, dtype=jnp.float32, progress=False, act_qtype=act_qtype, fuse=False)
  assert rel_l2(m.logits(ids), one.logits(ids), axis=-1).max() < 1e-5


SRC = DATA / "tiny-mixtral-q8_0.gguf"


@pytest.mark.parametrize(
  "change, message",
  [
    ({"llama.expert_count": 4}, r"experts 4 \(expert_count\)(.|\n)*'blk.0.ffn_up_exps.weight': shape \(8, 64, 64\), the metadata says \(4, 64, 64\)"),
    ({"llama.expert_used_count": 9}, r"llama.expert_used_count 9 must be in \[1, llama.expert_count 8\]"),
    ({"llama.expert_count": 0}, r"llama.expert_count is 0 \(absent: 0\), but it has 'blk.0.ffn_up_exps"),
  ],
)  # fmt: skip
def test_bad_expert_metadata_names_the_key_or_tensor(tmp_path, change, message):
  dst = tmp_path / "bad.gguf"
  rewrite(dst, src=SRC, meta=change)
  with pytest.raises(CheckpointError, match=message):
    load_gguf(dst, progress=False)


def test_an_unknown_gating_function_is_refused(tmp_path):
  dst = tmp_path / "bad.gguf"
  rewrite(dst, src=SRC, typed_meta={"llama.expert_gating_func": (7, V.UINT32, None)})
  with pytest.raises(
    CheckpointError, match=r"unknown expert gating function llama.expert_gating_func=7"
  ):
    load_gguf(dst, progress=False)


def test_a_missing_router_is_named(tmp_path):
  dst = tmp_path / "bad.gguf"
  rewrite(dst, src=SRC, drop=("blk.1.ffn_gate_inp.weight",))
  with pytest.raises(CheckpointError, match=r"missing:\s*'blk.1.ffn_gate_inp.weight'"):
    load_gguf(dst, progress=False)


def test_qwen3moe_without_experts_is_refused(tmp_path):
  dst = tmp_path / "bad.gguf"
  rewrite(dst, src=DATA / "tiny-qwen3moe-q8_0.gguf", meta={"qwen3moe.expert_count": 0})
  with pytest.raises(
    CheckpointError,
    match=r"qwen3moe.expert_count is 0 \(absent: 0\), but it has 'blk.0.ffn_up_exps",
  ):
    load_gguf(dst, progress=False)


def without_keys(dst: Path, src: Path, keys: tuple[str, ...], meta: dict | None = None) -> Path:
  """A copy of `src` without the metadata `keys` (and `meta`'s values replacing others')."""
  r = gguf.GGUFReader(src)
  w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
  for key, field in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture" or key in keys:
      continue
    vtype = V(field.types[0])
    sub = V(field.types[-1]) if vtype == V.ARRAY else None
    w.add_key_value(key, (meta or {}).get(key, field.contents()), vtype, sub)
  for t in r.tensors:
    w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return dst


@pytest.mark.parametrize(
  "drop, meta, ffn",
  [
    (("qwen3moe.feed_forward_length",), {}, 0),
    (("qwen3moe.expert_feed_forward_length",), {"qwen3moe.feed_forward_length": 64}, 64),
  ],
)
@pytest.mark.slow
def test_qwen3moe_optional_widths_are_llama_cpps(tmp_path, drop, meta, ffn):
  """llama.cpp reads `feed_forward_length` as optional (0) and takes the experts' width from
  `expert_feed_forward_length`, else feed_forward_length / expert_used_count (src/llama-model.cpp
  load_hparams, src/models/qwen3moe.cpp). A file without the one key (or with the other's
  fallback) is the same model to llama.cpp (its logits bit for bit those on the source file)
  and to us, within 1e-5 of llama.cpp per position (F32 file)."""
  from tests._llamacpp import llama_logits

  src = DATA / "tiny-qwen3moe-f32.gguf"
  dst = without_keys(tmp_path / "w.gguf", src, drop, meta)
  m = load_gguf(dst, dtype=jnp.float32, progress=False)
  assert (m.config.ffn, m.config.expert_ffn) == (ffn, 32)
  ids = refs("qwen3moe")["f32_tokens"][:-1]
  ours = m.logits(ids)
  np.testing.assert_array_equal(ours, on_f32_tokens(model("qwen3moe", "f32"), "qwen3moe"))
  assert rel_l2(ours, refs("qwen3moe")["f32_logits"], axis=-1).max() < 1e-5
  np.testing.assert_array_equal(llama_logits(dst, ids), llama_logits(src, ids))


def test_qwen3moe_without_any_expert_width_is_refused(tmp_path):
  """Neither width key: llama.cpp's experts would be 0 wide (its tensors' shapes fail); we name
  both keys."""
  keys = ("qwen3moe.feed_forward_length", "qwen3moe.expert_feed_forward_length")
  dst = without_keys(tmp_path / "w.gguf", DATA / "tiny-qwen3moe-q8_0.gguf", keys)
  with pytest.raises(
    CheckpointError,
    match=r"experts' width is unknown: qwen3moe.expert_feed_forward_length is absent and"
    r" qwen3moe.feed_forward_length is 0 \(absent: 0",
  ):
    load_gguf(dst, progress=False)


def test_lora_on_expert_stacks_loads_as_llama_cpp_stores_it(tmp_path):
  """llama.cpp applies a per-expert adapter (lora_a ggml [n_in, rank, n_expert]) to each routed
  expert; so does `load_gguf(lora=)` (tests/test_lora_gguf_experts.py against llama.cpp). The
  default targets of a MoE model are its attention matrices; the stacks are targets on request."""
  rng = np.random.default_rng(0)
  path = tmp_path / "exps-lora.gguf"
  w = gguf.GGUFWriter(path, "llama")
  w.add_string(gguf.Keys.General.TYPE, "adapter")
  w.add_string(gguf.Keys.Adapter.TYPE, "lora")
  w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
  w.add_tensor("blk.0.ffn_up_exps.weight.lora_a", rng.standard_normal((8, 4, 64), np.float32))
  w.add_tensor("blk.0.ffn_up_exps.weight.lora_b", rng.standard_normal((8, 64, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  loaded = load_gguf(SRC, lora=path, progress=False)
  assert loaded.lora.targets == ("ffn_up_exps",)
  assert loaded.params["layers"]["moe"]["up_exps_lora_a"].shape == (2, 8, 64, 4)
  m = model("mixtral", "q8_0")
  assert m.with_lora(rank=4, alpha=8.0, targets=["ffn_up_exps"]).lora.targets == ("ffn_up_exps",)
  assert m.with_lora(rank=4, alpha=8.0).lora.targets == (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
  )
