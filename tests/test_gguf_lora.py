"""LoRA on a loaded GGUF model: `with_lora`, training, llama.cpp adapter files, merging.

On the committed tiny files (tests/data/gguf_models, made by scripts/make_gguf_references.py):
outputs against a float64 numpy forward of the file's weights plus the adapters' deltas
(tests/gguf_numpy_forward.py), the base's bytes across training, adapter files read back as
llama.cpp lays them out, and the errors. The real model and llama.cpp itself are in
tests/test_real_gguf_lora.py (slow).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from q8rules.checkpoint import CheckpointError
from q8rules.llm import load_gguf
from q8rules.lora.gguf_file import read_lora_gguf, save_lora_gguf
from q8rules.lora.gguf_model import DEFAULT_TARGETS
from q8rules.lora.trainer import LoraTrainer, split_adapters
from q8rules.q8_0 import quantize
from tests._utils import matrix
from tests.gguf_numpy_forward import forward, load_float64

DATA = Path(__file__).parent / "data" / "gguf_models"
IDS = [1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 300, 11]


def tiny(arch: str) -> Path:
  return DATA / f"tiny-{arch}-q8_0.gguf"


@functools.cache
def base(arch: str, fuse: bool = True):
  return load_gguf(tiny(arch), dtype=jnp.float32, fuse=fuse)


def rel_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_b(m, seed: int, size: float = 0.05):
  """`m` with every adapter's B random (B starts at zero), A as initialized."""
  rng = np.random.default_rng(seed)
  base_params, adapters = split_adapters(m.params)

  def fill(path, leaf):
    name = str(path[-1].key)
    if name.endswith("_lora_b"):
      return jnp.asarray(rng.normal(0.0, size, leaf.shape).astype(np.float32))
    return leaf

  adapters = jax.tree_util.tree_map_with_path(fill, adapters)
  import dataclasses

  from q8rules.lora.trainer import join_adapters

  return dataclasses.replace(m, params=join_adapters(base_params, adapters))


def reference_logits(path: Path, adapters: dict, scale: float, ids) -> np.ndarray:
  """float64 forward of the file's weights with `scale * (A @ B).T` added to each adapted one."""
  hp, w = load_float64(path)
  for name, (a, b) in adapters.items():
    w[name] = w[name] + scale * (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).T
  return forward(hp, w, ids)


def base_leaves(params) -> list[np.ndarray]:
  base_params, _ = split_adapters(params)
  return [np.asarray(x).copy() for x in jax.tree.leaves(base_params)]


@pytest.mark.parametrize("arch", matrix(["llama", "qwen2", "phi3"], "qwen2"))
def test_zero_b_is_the_served_model_bit_for_bit(arch):
  """With B = 0 (the default start) the logits equal the Q8_0 model's, unfused as the adapted
  groups run (each member its own product), bit for bit."""
  m = base(arch).with_lora(rank=4, alpha=8.0)
  want = base(arch, fuse=False).logits(IDS)
  np.testing.assert_array_equal(m.logits(IDS), want)
  adapters = m.adapters()
  kinds = {n.split(".")[2] for n in adapters}
  expected = (
    {"attn_qkv", "attn_output", "ffn_up", "ffn_down"} if arch == "phi3" else set(DEFAULT_TARGETS)
  )
  assert kinds == expected
  assert len(adapters) == len(expected) * m.config.layers
  a, b = adapters["blk.1.attn_output.weight"]
  assert a.shape == (m.config.heads * m.config.head_dim, 4) and b.shape == (4, m.config.dim)
  assert not b.any() and np.abs(a).max() > 0


SLOW_ARCHS = [
  pytest.param(a, marks=pytest.mark.slow) for a in ("qwen3", "gemma2", "gemma3", "llama31")
]


@pytest.mark.parametrize("arch", [*matrix(["llama", "qwen2", "phi3"], "qwen2"), *SLOW_ARCHS])
def test_random_adapters_against_float64(arch):
  m = random_b(base(arch).with_lora(rank=4, alpha=8.0, seed=1), seed=2)
  got = m.logits(IDS)
  want = reference_logits(tiny(arch), m.adapters(), 8.0 / 4, IDS)
  assert rel_l2(got, want) < 1e-5
  assert rel_l2(base(arch).logits(IDS), want) > 1e-3  # the adapters changed the output


def test_targets_subset_keeps_other_groups_fused():
  m = base("llama").with_lora(rank=2, alpha=2.0, targets=["ffn_down", "attn_v"])
  assert m.lora.targets == ("attn_v", "ffn_down")
  assert not m.config.fused_qkv and m.config.fused_gate_up  # gate | up has no adapter
  assert set(n.split(".")[2] for n in m.adapters()) == {"attn_v", "ffn_down"}
  m = random_b(m, seed=3)
  want = reference_logits(tiny("llama"), m.adapters(), 1.0, IDS)
  assert rel_l2(m.logits(IDS), want) < 1e-5


@pytest.mark.slow
def test_training_lowers_the_loss_and_keeps_the_base():
  m = base("qwen2").with_lora(rank=4, alpha=8.0)
  before = base_leaves(m.params)
  trainer = LoraTrainer(m, optax.adam(1e-2))
  state = trainer.init()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, m.config.vocab, size=(2, 16))
  mask = np.ones_like(tokens, bool)
  mask[:, :4] = False
  first = float(trainer.loss(state, tokens, mask))
  assert first == pytest.approx(m.loss(tokens, mask), rel=1e-6)
  for _ in range(8):
    state, loss = trainer.step(state, tokens, mask)
  last = float(trainer.loss(state, tokens, mask))
  assert last < first - 0.5, (first, last)
  trained = trainer.model(state)
  assert trained.loss(tokens, mask) == pytest.approx(last, rel=1e-5)
  for x, y in zip(before, base_leaves(trained.params), strict=True):
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
  for x, y in zip(before, base_leaves(m.params), strict=True):  # the start model too
    assert x.tobytes() == y.tobytes()


def test_loss_mask_counts_the_predicted_positions():
  m = base("llama")
  tokens = np.asarray(IDS)
  logits = m.logits(IDS).astype(np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  logp -= logits.max(-1, keepdims=True)
  nll = -logp[np.arange(len(IDS) - 1), tokens[1:]]
  mask = np.zeros(len(IDS), bool)
  mask[5:] = True
  assert m.loss(IDS) == pytest.approx(nll.mean(), rel=1e-5)
  assert m.loss(IDS, mask) == pytest.approx(nll[4:].mean(), rel=1e-5)


def test_adapter_file_as_llama_cpp_lays_it_out(tmp_path):
  m = random_b(base("llama").with_lora(rank=4, alpha=8.0), seed=4)
  path = m.save_lora_gguf(tmp_path / "adapter.gguf")
  r = gguf.GGUFReader(path)
  assert r.get_field("general.type").contents() == "adapter"
  assert r.get_field("adapter.type").contents() == "lora"
  assert r.get_field("adapter.lora.alpha").contents() == 8.0
  assert r.get_field("general.architecture").contents() == "llama"
  tensors = {t.name: t for t in r.tensors}
  a, b = m.adapters()["blk.0.attn_q.weight"]
  ta, tb = tensors["blk.0.attn_q.weight.lora_a"], tensors["blk.0.attn_q.weight.lora_b"]
  assert list(ta.shape) == [a.shape[0], 4] and list(tb.shape) == [4, b.shape[1]]  # ggml ne
  assert ta.tensor_type == gguf.GGMLQuantizationType.F32
  np.testing.assert_array_equal(ta.data, a.T)
  np.testing.assert_array_equal(tb.data, b.T)
  assert len(tensors) == 2 * len(m.adapters())
  assert not [p for p in os.listdir(tmp_path) if p != "adapter.gguf"]  # no temporary left


def test_adapter_file_round_trip(tmp_path):
  m = random_b(base("qwen2").with_lora(rank=4, alpha=8.0), seed=5)
  m.save_lora_gguf(tmp_path / "a.gguf")
  back = load_gguf(tiny("qwen2"), dtype=jnp.float32, lora=tmp_path / "a.gguf")
  assert back.lora.rank == 4 and back.lora.alpha == 8.0
  np.testing.assert_array_equal(back.logits(IDS), m.logits(IDS))
  for name, (a, b) in m.adapters().items():
    np.testing.assert_array_equal(back.adapters()[name][0], a)
    np.testing.assert_array_equal(back.adapters()[name][1], b)
  half = load_gguf(tiny("qwen2"), dtype=jnp.float32, lora=tmp_path / "a.gguf", lora_scale=0.5)
  assert half.lora.alpha == 4.0
  want = reference_logits(tiny("qwen2"), m.adapters(), 0.5 * 8.0 / 4, IDS)
  assert rel_l2(half.logits(IDS), want) < 1e-5


def test_f16_adapter_file(tmp_path):
  m = random_b(base("llama").with_lora(rank=2, alpha=2.0, targets=["attn_q"]), seed=6)
  m.save_lora_gguf(tmp_path / "a16.gguf", dtype="f16")
  f = read_lora_gguf(tmp_path / "a16.gguf")
  for name, (a, b) in m.adapters().items():
    np.testing.assert_array_equal(f.adapters[name][0], a.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(f.adapters[name][1], b.astype(np.float16).astype(np.float32))


@pytest.mark.slow
def test_several_adapter_files_add_up(tmp_path):
  """As llama.cpp sums several adapters' deltas, each with its own scale; a layer or tensor an
  adapter does not cover gets none of its delta."""
  one = random_b(base("llama").with_lora(rank=2, alpha=4.0, targets=["attn_q", "ffn_up"]), 7)
  two = random_b(base("llama").with_lora(rank=3, alpha=3.0, targets=["attn_q"], seed=9), 8)
  one.save_lora_gguf(tmp_path / "one.gguf")
  adapters_two = {k: v for k, v in two.adapters().items() if k.startswith("blk.0.")}
  save_lora_gguf(tmp_path / "two.gguf", adapters_two, arch="llama", alpha=3.0)
  m = load_gguf(
    tiny("llama"),
    dtype=jnp.float32,
    lora=[tmp_path / "one.gguf", tmp_path / "two.gguf"],
    lora_scale=[1.0, -0.5],
  )
  hp, w = load_float64(tiny("llama"))
  for adapters, s in ((one.adapters(), 2.0), (adapters_two, -0.5)):
    for name, (a, b) in adapters.items():
      w[name] = w[name] + s * (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).T
  assert rel_l2(m.logits(IDS), forward(hp, w, IDS)) < 1e-5


@pytest.mark.slow
def test_merged_is_the_requantized_sum():
  """Each adapted tensor of `merged()` is Q8_0 of float32(q * d + alpha / rank * A @ B) (gguf's
  quantizer: `q8rules.quantize` matches it bit for bit); the fused groups are fused again."""
  m = random_b(base("llama").with_lora(rank=4, alpha=8.0), seed=10)
  merged = m.merged()
  assert merged.lora is None and merged.config.fused_qkv and merged.config.fused_gate_up
  hp, w = load_float64(tiny("llama"))
  q, k = hp["heads"] * hp["head_dim"], hp["kv_heads"] * hp["head_dim"]
  kernel = merged.params["layers"]["attn"]["qkv"]["kernel"].array
  for layer in range(m.config.layers):
    name = f"blk.{layer}.attn_k.weight"
    a, b = m.adapters()[name]
    float32 = (w[name].T + 2.0 * (a.astype(np.float64) @ b.astype(np.float64))).astype(np.float32)
    want = quantize(float32, axis=0, scale_dtype=np.float16)
    np.testing.assert_array_equal(np.asarray(kernel.q[layer])[:, q : q + k], want.q)
    np.testing.assert_array_equal(np.asarray(kernel.scale[layer])[:, q : q + k], want.scale)
  reference = reference_logits(tiny("llama"), m.adapters(), 2.0, IDS)
  assert rel_l2(merged.logits(IDS), reference) < 2e-2  # one more Q8_0 rounding of each weight


# ---- errors ---------------------------------------------------------------------------------


def test_with_lora_errors():
  m = base("llama")
  with pytest.raises(ValueError, match="unknown LoRA target.*attn_x"):
    m.with_lora(targets=["attn_x"])
  with pytest.raises(ValueError, match=r"no tensor for LoRA target.*attn_qkv"):
    m.with_lora(targets=["attn_qkv"])
  with pytest.raises(ValueError, match="rank 300 exceeds min"):
    m.with_lora(rank=300)
  with pytest.raises(ValueError, match="alpha"):
    m.with_lora(alpha=0.0)
  adapted = m.with_lora(rank=2)
  with pytest.raises(ValueError, match="has LoRA adapters already"):
    adapted.with_lora(rank=2)
  with pytest.raises(ValueError, match="no LoRA adapters to merge"):
    m.merged()
  with pytest.raises(ValueError, match="no LoRA adapters"):
    m.save_lora_gguf("/tmp/never.gguf")
  f32 = load_gguf(DATA / "tiny-llama-f32.gguf", dtype=jnp.float32)
  with pytest.raises(ValueError, match="not a Q8_0 weight.*quantize='q8_0'"):
    f32.with_lora(rank=2)


def test_adapter_file_errors(tmp_path):
  m = random_b(base("llama").with_lora(rank=2, alpha=2.0, targets=["attn_q"]), seed=11)
  good = m.save_lora_gguf(tmp_path / "good.gguf")
  with pytest.raises(CheckpointError, match="arch 'llama'.*is 'qwen2'"):
    load_gguf(tiny("qwen2"), lora=good)
  with pytest.raises(ValueError, match="finite"):
    load_gguf(tiny("llama"), lora=good, lora_scale=float("nan"))
  with pytest.raises(ValueError, match="2 lora_scale value"):
    load_gguf(tiny("llama"), lora=good, lora_scale=[1.0, 2.0])
  a, b = m.adapters()["blk.0.attn_q.weight"]
  wrong = save_lora_gguf(
    tmp_path / "wrong.gguf", {"blk.0.attn_q.weight": (a[:64], b)}, arch="llama", alpha=2.0
  )
  with pytest.raises(CheckpointError, match="blk.0.attn_q.weight.*do not fit"):
    load_gguf(tiny("llama"), lora=wrong)
  missing = save_lora_gguf(
    tmp_path / "missing.gguf", {"blk.9.attn_q.weight": (a, b)}, arch="llama", alpha=2.0
  )
  with pytest.raises(CheckpointError, match="blk.9.attn_q.weight.*does not exist in the base"):
    load_gguf(tiny("llama"), lora=missing)
  embd = save_lora_gguf(
    tmp_path / "embd.gguf", {"token_embd.weight": (a, b)}, arch="llama", alpha=2.0
  )
  with pytest.raises(CheckpointError, match="token_embd.weight"):
    load_gguf(tiny("llama"), lora=embd)
  with pytest.raises(CheckpointError, match="general.type is None"):
    load_gguf(tiny("llama"), lora=tiny("llama"))
  half = tmp_path / "half.gguf"
  w = gguf.GGUFWriter(half, "llama")
  w.add_type(gguf.GGUFType.ADAPTER)
  w.add_string("adapter.type", "lora")
  w.add_float32("adapter.lora.alpha", 2.0)
  w.add_tensor("blk.0.attn_q.weight.lora_a", a.T.copy())
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="missing its lora_b"):
    read_lora_gguf(half)
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(Path(good).read_bytes()[:-100])
  with pytest.raises(CheckpointError, match="truncated.gguf"):
    read_lora_gguf(truncated)
  with pytest.raises(CheckpointError, match="cannot write"):
    m.save_lora_gguf(tmp_path / "no-such-dir" / "a.gguf")
  with pytest.raises(ValueError, match="non-finite"):
    save_lora_gguf(
      tmp_path / "nan.gguf", {"blk.0.attn_q.weight": (a * np.nan, b)}, arch="llama", alpha=2.0
    )
  assert not (tmp_path / "nan.gguf").exists()
  assert sorted(os.listdir(tmp_path)) == [
    "embd.gguf",
    "good.gguf",
    "half.gguf",
    "missing.gguf",
    "truncated.gguf",
    "wrong.gguf",
  ]


# ---- the command line and the chat data -----------------------------------------------------


@pytest.mark.slow
def test_finetune_command_writes_an_adapter_run_reads(tmp_path, capsys):
  from q8rules.cli import main

  text = tmp_path / "notes.txt"
  text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
  out = tmp_path / "adapter.gguf"
  qwen2 = str(tiny("qwen2"))
  args = ["finetune", qwen2, "--text", str(text), "--out", str(out), "--rank", "4"]
  args += ["--steps", "6", "--batch", "2", "--length", "32", "--lr", "1e-2", "--log-every", "3"]
  assert main([*args, "--no-progress"]) == 0
  err = capsys.readouterr().err
  assert "step 3: train loss" in err and "step 6: train loss" in err and f"wrote {out}" in err
  f = read_lora_gguf(out)
  assert f.arch == "qwen2" and f.alpha == 32.0 and len(f.adapters) == 7 * 2
  assert any(np.abs(b).max() > 0 for _, b in f.adapters.values())  # trained: B moved off zero
  assert (
    main(["run", qwen2, "-p", "The quick", "-n", "4", "--lora", str(out), "--no-progress"]) == 0
  )
  printed = capsys.readouterr()
  assert "LoRA: " in printed.err
  m = load_gguf(tiny("qwen2"), dtype=jnp.float32, lora=out)
  ids = m.tokenizer.encode("The quick")
  new = m.generate(ids, 4, stop_ids=sorted(m.tokenizer.eog_ids))
  assert printed.out == m.tokenizer.decode(new) + "\n"


@pytest.mark.parametrize(
  "extra, status, message",
  [
    (["--lora-scale", "inf"], 2, "'inf' is not a finite number"),
    (["--lora", "/no/such/adapter.gguf"], 1, "/no/such/adapter.gguf: not a readable GGUF"),
  ],
)
def test_run_lora_errors(extra, status, message, capsys):
  from q8rules.cli import main

  with pytest.raises(SystemExit) as e:
    main(["run", str(tiny("qwen2")), "-n", "2", "--no-progress", *extra])
  assert e.value.code == status
  assert message in capsys.readouterr().err


def test_chat_data_counts_the_replies_only(tmp_path):
  from q8rules.lora.datasets import chat_batches, conversation_ids, read_conversations
  from tests.test_chat import chat_model

  m = chat_model(tmp_path)
  conv = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a fox."},
    {"role": "assistant", "content": "Brown."},
    {"role": "user", "content": "And a dog?"},
    {"role": "assistant", "content": "Lazy."},
  ]
  ids, mask = conversation_ids(m, conv)
  assert ids == m.apply_chat_template(conv, add_generation_prompt=False)
  text = m.tokenizer.decode([i for i, t in zip(ids, mask, strict=True) if t])
  assert "Brown." in text and "Lazy." in text and "fox" not in text and "Be brief" not in text
  path = tmp_path / "chats.jsonl"
  path.write_text(json.dumps({"messages": conv}) + "\n")
  (conversations,) = [read_conversations(path)]
  length = len(ids) + 8
  tokens, masks = chat_batches(m, conversations, length, 2)()
  assert tokens.shape == (2, length) and masks.sum() == 2 * sum(mask) and not masks[:, -8:].any()
  np.testing.assert_array_equal(tokens[:, : len(ids)], [ids, ids])
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:1: no assistant message"):
    read_conversations(bad)


@pytest.mark.slow
@pytest.mark.heavy
def test_adapters_on_a_mesh_follow_their_base(tmp_path):
  """On a 2-device 'tp' mesh: A split along K under the row-parallel o / down, B along N under
  the column-parallel q / k / v / gate / up; the logits and a training step equal one
  device's."""
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs 2 devices; the {jax.default_backend()} backend has {len(devices)}")
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:2])
  single = random_b(base("llama").with_lora(rank=4, alpha=8.0), seed=12)
  single.save_lora_gguf(tmp_path / "a.gguf")
  sharded = load_gguf(tiny("llama"), dtype=jnp.float32, mesh=mesh, lora=tmp_path / "a.gguf")
  attn, mlp = sharded.params["layers"]["attn"], sharded.params["layers"]["mlp"]
  for node, split in ((attn["q"], "b"), (attn["v"], "b"), (mlp["up"], "b"), (attn["o"], "a")):
    part = node[f"kernel_lora_{split}"]
    axis = -2 if split == "a" else -1
    assert part.sharding.shard_shape(part.shape)[axis] == part.shape[axis] // 2
  np.testing.assert_allclose(sharded.logits(IDS), single.logits(IDS), rtol=2e-5, atol=2e-5)
  tokens = np.asarray([IDS, IDS[::-1]])
  losses = []
  for m in (single, sharded):
    trainer = LoraTrainer(m, optax.adam(1e-2))
    state, _ = trainer.step(trainer.init(), tokens)
    losses.append(float(trainer.loss(state, tokens)))
  assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
def test_unrolled_layers(tmp_path):
  """Layers unrolled (`layers_0`, ...): one adapter per layer's param, the same numbers, and the
  adapter file the scanned model writes."""
  scanned = random_b(base("qwen2").with_lora(rank=4, alpha=8.0), seed=13)
  scanned.save_lora_gguf(tmp_path / "a.gguf")
  m = load_gguf(tiny("qwen2"), dtype=jnp.float32).unrolled()
  from q8rules.lora.convert import attach_lora_files
  from q8rules.lora.gguf_file import read_lora_gguf as read

  adapted = attach_lora_files(m, [read(tmp_path / "a.gguf")], [1.0])
  assert "kernel_lora_a" in adapted.params["layers_1"]["attn"]["q"]
  want = reference_logits(tiny("qwen2"), scanned.adapters(), 2.0, IDS)
  assert rel_l2(adapted.logits(IDS), want) < 1e-5
  for name, (a, b) in scanned.adapters().items():
    np.testing.assert_array_equal(adapted.adapters()[name][0], a)
    np.testing.assert_array_equal(adapted.adapters()[name][1], b)
  fresh = m.with_lora(rank=2, alpha=2.0, targets=["ffn_down"])
  assert set(fresh.adapters()) == {f"blk.{i}.ffn_down.weight" for i in range(m.config.layers)}


@pytest.mark.slow
def test_merged_file_for_llama_cpp(tmp_path):
  """`save_gguf` of an adapted model writes `merged()`: read back, its params are the merged
  model's bit for bit (the untouched tensors the source's bytes); llama.cpp runs the file and
  stays as close to us as on the source file (at most 1.5x its difference there)."""
  from tests._llamacpp import llama_logits

  m = random_b(base("llama").with_lora(rank=4, alpha=8.0, targets=["attn_v", "ffn_down"]), 14)
  out = m.save_gguf(tmp_path / "merged.gguf")
  merged = m.merged()
  back = load_gguf(out, dtype=jnp.float32)
  for x, y in zip(jax.tree.leaves(back.params), jax.tree.leaves(merged.params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  src, dst = gguf.GGUFReader(tiny("llama")), gguf.GGUFReader(out)
  changed = {t.name for t in src.tensors} - {
    t.name
    for t, u in zip(src.tensors, dst.tensors, strict=True)
    if np.asarray(t.data).tobytes() == np.asarray(u.data).tobytes()
  }
  assert changed == {f"blk.{i}.{k}.weight" for i in range(2) for k in ("attn_v", "ffn_down")}
  ours_src, ours_out = base("llama").logits(IDS), back.logits(IDS)
  gap_src = rel_l2(ours_src, llama_logits(tiny("llama"), IDS))
  gap_out = rel_l2(ours_out, llama_logits(out, IDS))
  assert rel_l2(ours_out, ours_src) > 10 * gap_out  # the merge moved the model
  assert gap_out <= 1.5 * max(gap_src, 1e-6), (gap_out, gap_src)
