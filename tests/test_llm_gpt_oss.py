"""gpt-oss (llama.cpp's openai-moe): its clamped SwiGLU and experts against float64
(tests/gpt_oss_numpy_forward.py); the small gpt-oss files of scripts/gguf_gpt_oss.py (F32,
Q8_0, and llama.cpp's own MXFP4) against llama.cpp's logits, greedy tokens, token ids and
chat renderings on them (tests/data/gguf_models/tiny-gpt-oss.npz) and against float64."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import gguf as gguf_checkpoint
from q8rules.llm import GGUFModel, load_gguf
from q8rules.llm.save import save_gguf
from q8rules.models import TransformerConfig
from q8rules.models.moe import Moe, gated
from tests._utils import matrix
from tests.gpt_oss_numpy_forward import experts, forward, load_float64, swiglu_oai

DATE = re.compile(r"Current date: \d{4}-\d{2}-\d{2}")
"""The harmony template's date line (`strftime_now`: the day it renders)."""


def rel(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swiglu_oai(rng, dtype):
  """Against float64, gate and up over both sides of the clamp (|x| up to 12)."""
  gate = rng.uniform(-12, 12, (64, 96)).astype(np.float32)
  up = rng.uniform(-12, 12, (64, 96)).astype(np.float32)
  config = TransformerConfig(activation="swiglu_oai", dtype=dtype)
  got = gated(config, jnp.asarray(gate, dtype), jnp.asarray(up, dtype))
  assert got.dtype == dtype
  g64, u64 = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (gate, up))
  assert rel(got, swiglu_oai(g64, u64)) < (2e-7 if dtype == jnp.float32 else 8e-3)
  assert (gate > 7).any() and (up < -7).any() and (up > 7).any()


def test_unknown_activation_is_refused():
  with pytest.raises(ValueError, match="'silu', 'gelu_tanh' or 'swiglu_oai', got 'relu'"):
    TransformerConfig(activation="relu")


MOE = TransformerConfig(
  arch="gpt-oss",
  dim=64,
  ffn=32,
  experts=8,
  experts_used=4,
  expert_gating="softmax_weight",
  expert_router_bias=True,
  expert_bias=True,
  activation="swiglu_oai",
)


def test_experts_match_float64(rng):
  """gpt-oss's routing (top 4 of the router's logits with its bias, softmax over the 4), its
  per-expert biases and clamped SwiGLU: `Moe` against gpt_oss_numpy_forward's experts."""
  c = MOE
  x = jnp.asarray(rng.standard_normal((2, 5, c.dim)), jnp.float32)
  moe = Moe(c)
  params = moe.init(jax.random.key(0), x)["params"]

  def draw(path: tuple, leaf: jax.Array) -> jax.Array:
    fan_in = leaf.shape[-2] if leaf.ndim >= 2 else 1
    scale = 3.0 / math.sqrt(fan_in) if leaf.ndim >= 2 else 0.5
    return jnp.asarray(rng.standard_normal(leaf.shape) * scale, jnp.float32)

  params = jax.tree_util.tree_map_with_path(draw, params)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  w = {
    "ffn_gate_inp.weight": p["gate_inp"]["kernel"].T,
    "ffn_gate_inp.bias": p["gate_inp"]["bias"],
  }
  for name in ("gate", "up", "down"):
    w[f"ffn_{name}_exps.weight"] = p[f"{name}_exps"].transpose(0, 2, 1)
    w[f"ffn_{name}_exps.bias"] = p[f"{name}_exps_bias"].T  # (n, E): GGUF's [E, n] swapped
  got = moe.apply({"params": params}, x)
  h = np.asarray(x, np.float64).reshape(-1, c.dim)
  want = experts({"experts_used": c.experts_used}, w, "", h).reshape(x.shape)
  assert rel(got, want) < 1e-5


# ---- the GGUF files (scripts/gguf_gpt_oss.py) against llama.cpp and float64 ----

DATA = Path(__file__).parent / "data" / "gguf_models"
KINDS = ("f32", "q8_0", "mxfp4")

F32_VS_LLAMA_CPP = 2e-5
"""Per-position rel. L2 bound of the F32 file's logits against llama.cpp's (measured 2.5e-6;
the issue's target is 1e-3)."""
VS_FLOAT64 = 1e-5
"""Rel. L2 bound of each file's logits against the float64 forward of the same file's weights
(the Q8_0 and MXFP4 files as llama.cpp dequantizes them)."""


@functools.cache
def model(kind: str) -> GGUFModel:
  return load_gguf(DATA / f"tiny-gpt-oss-{kind}.gguf", dtype=jnp.float32, progress=False)


@functools.cache
def refs() -> dict[str, np.ndarray]:
  with np.load(DATA / "tiny-gpt-oss.npz") as z:
    return {k: z[k] for k in z.files}


@functools.cache
def logits(kind: str) -> np.ndarray:
  """Our logits on the F32 run's tokens (prompt + llama.cpp's greedy continuation)."""
  return np.asarray(model(kind).logits(refs()["f32_tokens"][:-1].tolist()))


def per_position(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def test_config_is_read_as_llama_cpp_reads_it():
  c = model("q8_0").config
  want = dict(
    arch="gpt-oss",
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=16,
    rope_style="halves",
    rope_scaling="yarn",
    rope_factor=32.0,
    rope_original_context=4096,
    rope_base=150000.0,
    rope_base_local=150000.0,
    rope_factor_local=32.0,
    qkv_bias=True,
    attn_output_bias=True,
    attn_sinks=True,
    tied_embeddings=False,
    sliding_window=8,
    local_layers=(True, False, True, False),
    experts=8,
    experts_used=4,
    expert_ffn=32,
    expert_gating="softmax_weight",
    expert_weights_norm=False,
    expert_router_bias=True,
    expert_bias=True,
    activation="swiglu_oai",
  )
  assert {k: getattr(c, k) for k in want} == want


def test_f32_logits_are_llama_cpps():
  """Every position within F32_VS_LLAMA_CPP of llama.cpp's (47 tokens: the window of 8 wraps
  on the local layers)."""
  worst = per_position(logits("f32"), refs()["f32_logits"]).max()
  assert worst < F32_VS_LLAMA_CPP, worst


@pytest.mark.parametrize("kind", KINDS)
def test_logits_are_the_float64_forward_of_the_files_weights(kind):
  """Against tests/gpt_oss_numpy_forward.py on the file's own weights: exact up to float32
  rounding for F32 and Q8_0 (its blocks served as stored); for MXFP4 the requantization to
  Q8_0 is the difference (`test_mxfp4_loads_with_no_flag` bounds it)."""
  hp, w = load_float64(DATA / f"tiny-gpt-oss-{kind}.gguf")
  ids = refs()["f32_tokens"][:-1]
  err = rel(logits(kind), forward(hp, w, ids))
  assert err < (VS_FLOAT64 if kind != "mxfp4" else 0.2), err


def test_greedy_32_tokens_are_llama_cpps():
  """Greedy decoding through the KV cache (sinks on every one-token step, the local layers'
  ring wrapped) gives llama.cpp's 32 tokens on the F32 file."""
  r = refs()
  prompt = r["prompt_ids"].tolist()
  assert model("f32").generate(prompt, 32) == r["f32_tokens"][len(prompt) :].tolist()


def test_q8_0_no_farther_from_f32_than_llama_cpps_q8_0():
  """On the same tokens, our Q8_0 logits against the F32 model's (llama.cpp's) are no farther
  than llama.cpp's own Q8_0 run (which also rounds the activations to Q8_0): measured 0.049
  against 0.096 (rel. L2 over every logit)."""
  r = refs()
  ours = rel(logits("q8_0"), r["f32_logits"])
  theirs = rel(r["q8_on_f32_logits"], r["f32_logits"])
  assert ours <= theirs, (ours, theirs)


def test_mxfp4_loads_with_no_flag():
  """llama.cpp's own MXFP4 file (MXFP4_MOE: the expert stacks MXFP4, the rest Q8_0) loads as
  it is, every expert stack requantized to Q8_0, bit for bit gguf.quants' dequantize then
  Q8_0 quantize; the logits' error against the F32 model stands beside llama.cpp's own on the
  file (measured 0.482 against 0.477: MXFP4's error dominates either)."""
  m, r = model("mxfp4"), refs()
  assert m.requantized == {"MXFP4": 12}
  path = DATA / "tiny-gpt-oss-mxfp4.gguf"
  t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down_exps.weight")
  assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
  got = gguf_checkpoint.load(path, layout="gguf").get_tensor(t.name)  # (E, D, F) blocked on F
  blocks = gguf.quants.quantize(
    gguf.quants.dequantize(t.data, t.tensor_type), gguf.GGMLQuantizationType.Q8_0
  ).reshape(*got.scale.shape, 34)
  q = blocks[..., 2:].copy().view(np.int8).reshape(got.q.shape)
  np.testing.assert_array_equal(np.asarray(got.q), q)
  np.testing.assert_array_equal(
    np.asarray(got.scale), blocks[..., :2].copy().view(np.float16)[..., 0]
  )
  ours = rel(logits("mxfp4"), r["f32_logits"])
  theirs = rel(r["mxfp4_on_f32_logits"], r["f32_logits"])
  assert ours <= 1.25 * theirs, (ours, theirs)


def test_token_ids_are_llama_cpps():
  """The gpt-4o pre-tokenizer (o200k's regex) on the file's BPE: llama.cpp's ids of each
  string, among them a text of 100+ tokens in several scripts, digits and code."""
  r, tok = refs(), model("q8_0").tokenizer
  offsets = r["tok_offsets"]
  for i, text in enumerate(r["tok_strings"]):
    want = r["tok_ids"][offsets[i] : offsets[i + 1]].tolist()
    assert tok.encode(str(text), add_special=False) == want, text
  assert offsets[-1] - offsets[-2] >= 100


def test_harmony_template_renders_as_llama_cpp_python():
  """gpt-oss's harmony template (the file's tokenizer.chat_template) renders as
  llama-cpp-python's Jinja2ChatFormatter (the date line aside: strftime_now is today's), and
  the rendering's ids (special tokens parsed) are llama.cpp's."""
  r, m = refs(), model("q8_0")
  offsets = r["chat_offsets"]
  for i in range(len(r["chat_names"])):
    messages = json.loads(str(r["chat_messages"]))[i]
    text = m.apply_chat_template(messages, tokenize=False)
    want = str(r["chat_texts"][i])
    assert DATE.sub("", text) == DATE.sub("", want)
    assert text.endswith("<|start|>assistant")  # the generation prompt
    ids = m.tokenizer.encode(want, add_special=False, parse_special=True)
    assert ids == r["chat_ids"][offsets[i] : offsets[i + 1]].tolist()


def rewritten(
  dst: Path,
  *,
  drop_keys: tuple[str, ...] = (),
  drop: tuple[str, ...] = (),
  meta: dict | None = None,
) -> Path:
  """The Q8_0 file copied by gguf-py without the keys `drop_keys` and tensors `drop`, with the
  (integer) keys of `meta` set."""
  r = gguf.GGUFReader(DATA / "tiny-gpt-oss-q8_0.gguf")
  w = gguf.GGUFWriter(dst, "gpt-oss")
  for key, field in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
      continue
    vtype = gguf.GGUFValueType(field.types[0])
    sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(key, (meta or {}).get(key, field.contents()), vtype, sub)
  for t in r.tensors:
    if t.name not in drop:
      w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return dst


@pytest.mark.parametrize(
  ("change", "message"),
  [
    (
      dict(drop_keys=("gpt-oss.attention.sliding_window",)),
      r"gpt-oss needs 'gpt-oss.attention.sliding_window' > 0 .*: it is missing",
    ),
    (
      dict(meta={"gpt-oss.attention.sliding_window": 0}),
      r"gpt-oss needs 'gpt-oss.attention.sliding_window' > 0 .*: it is 0",
    ),
    (
      dict(drop_keys=("gpt-oss.expert_feed_forward_length",)),
      r"no 'gpt-oss.expert_feed_forward_length'",
    ),
    (dict(drop=("blk.2.attn_sinks.weight",)), r"missing:\n.*'blk.2.attn_sinks.weight'"),
    (dict(drop=("blk.0.ffn_up_exps.bias",)), r"missing:\n.*'blk.0.ffn_up_exps.bias'"),
    (
      dict(meta={"gpt-oss.expert_count": 6}),
      r"'blk.0.ffn_gate_exps.weight': shape \(8, 32, 64\), the metadata says \(6, 32, 64\)",
    ),
  ],
  ids=["no-window", "window-0", "no-expert-ffn", "no-sinks", "no-expert-bias", "expert-count"],
)
def test_bad_files_name_the_key_or_tensor(tmp_path, change, message):
  path = rewritten(tmp_path / "bad.gguf", **change)
  with pytest.raises(CheckpointError, match=message) as e:
    load_gguf(path, dtype=jnp.float32, progress=False)
  assert str(path) in str(e.value)


@pytest.mark.parametrize("kind", matrix(["q8_0", "mxfp4"], "mxfp4"))
def test_save_gguf_round_trip(tmp_path, kind):
  """save_gguf writes every tensor as the source file has it (MXFP4 stacks stay MXFP4, sinks
  and bias stacks F32), so the file loads back to the same logits."""
  out = tmp_path / f"saved-{kind}.gguf"
  save_gguf(model(kind), out)
  source = {t.name: t for t in gguf.GGUFReader(DATA / f"tiny-gpt-oss-{kind}.gguf").tensors}
  saved = {t.name: t for t in gguf.GGUFReader(out).tensors}
  assert saved.keys() == source.keys()
  for name, t in source.items():
    assert saved[name].tensor_type == t.tensor_type, name
    assert np.asarray(saved[name].data).tobytes() == np.asarray(t.data).tobytes(), name
  ids = refs()["f32_tokens"][:12].tolist()
  again = load_gguf(out, dtype=jnp.float32, progress=False)
  np.testing.assert_array_equal(again.logits(ids), model(kind).logits(ids))
