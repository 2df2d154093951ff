"""LoRA adapters on expert stacks (`ffn_gate_exps`, `ffn_up_exps`, `ffn_gate_up_exps`,
`ffn_down_exps`), one per expert, in llama.cpp's adapter layout, against llama.cpp itself.

llama.cpp loads a per-expert pair `<stack>.lora_a` ggml [n_in, rank, n_expert] and `.lora_b`
[rank, n_out, n_expert] (src/llama-adapter.cpp checks ne[0] and ne[1] as for a matrix) and
`build_lora_mm_id` (src/llama-graph.cpp) adds `scale * B_e @ (A_e @ x)` to each routed expert's
product by `ggml_mul_mat_id`. On the tiny MoE files (tests/data/gguf_models, scripts/gguf_moe.py,
scripts/gguf_gemma4.py): our adapted model against a float64 forward of the file's weights plus
each expert's delta, and our adapter file given to llama.cpp (`lora_path`): on the F32 file its
logits are that float64 forward's, on the Q8_0 file it differs from us no more than without the
adapter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import tempfile
import textwrap
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.checkpoint import CheckpointError
from q8rules.llm import load_gguf
from q8rules.lora.gguf_file import read_lora_gguf, save_lora_gguf
from q8rules.lora.trainer import join_adapters, split_adapters
from tests._llamacpp import llama_cpp_python
from tests._utils import matrix
from tests.gguf_numpy_forward import forward, load_float64

DATA = Path(__file__).parent / "data" / "gguf_models"
EXPERTS = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]

LLAMA_SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
kw = dict(lora_path=sys.argv[4]) if len(sys.argv) > 4 else {}
llm = Llama(path, n_ctx=max(64, len(ids)), n_batch=128, logits_all=True, verbose=False,
            n_threads=2, type_k=0, type_v=0, flash_attn=False, **kw)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], np.float32))
"""


def llama_logits(path: Path, ids, lora: Path | None = None) -> np.ndarray:
  """llama.cpp's logits (T, vocab) on `path` with the adapter file `lora` (F32 KV cache, no
  flash attention: the F32 file's numbers are not rounded through F16)."""
  py = llama_cpp_python()
  if py is None:
    pytest.skip("llama-cpp-python not found (set Q8RULES_LLAMA_CPP_PYTHON)")
  with tempfile.TemporaryDirectory() as d:
    out = Path(d) / "logits.npy"
    cmd = [py, "-c", textwrap.dedent(LLAMA_SCRIPT), str(path), json.dumps([int(i) for i in ids])]
    cmd += [str(out), *([str(lora)] if lora else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"llama.cpp could not run {path}:\n{res.stderr[-3000:]}"
    return np.load(out).astype(np.float64)


def tiny(name: str, kind: str = "q8_0") -> Path:
  return DATA / f"tiny-{name}-{kind}.gguf"


@functools.cache
def base(name: str, fuse: bool = True):
  return load_gguf(tiny(name), dtype=jnp.float32, fuse=fuse, progress=False)


@functools.cache
def ids(name: str) -> list[int]:
  with np.load(DATA / f"tiny-{name}.npz") as z:
    return z["f32_tokens"][:-1].tolist()


def rel_l2(a, b, axis=-1) -> np.ndarray:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def random_b(m, seed: int, size: float = 0.03):
  """`m` with every adapter's B random (B starts at zero), A as initialized."""
  rng = np.random.default_rng(seed)
  base_params, adapters = split_adapters(m.params)

  def fill(path, leaf):
    if str(path[-1].key).endswith("_lora_b"):
      return jnp.asarray(rng.normal(0.0, size, leaf.shape).astype(np.float32))
    return leaf

  adapters = jax.tree_util.tree_map_with_path(fill, adapters)
  return dataclasses.replace(m, params=join_adapters(base_params, adapters))


def reference(path: Path, adapters: dict, scale: float, tokens) -> np.ndarray:
  """float64 forward of the file's weights, `scale * (A @ B)` added to each adapted matrix (to
  each expert's, in GGUF numpy order (E, N, K))."""
  hp, w = load_float64(path)
  for name, (a, b) in adapters.items():
    delta = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    w[name] = w[name] + scale * np.swapaxes(delta, -1, -2)
  return forward(hp, w, tokens)


@functools.cache
def adapted(name: str):
  """The Q8_0 model with rank-4 adapters (alpha 8) on attn_q and every expert stack, B random."""
  m = base(name).with_lora(rank=4, alpha=8.0, targets=["attn_q", *EXPERTS], seed=1)
  return random_b(m, seed=2)


@pytest.mark.parametrize("name", matrix(["qwen3moe", "mixtral"], "mixtral"))
def test_zero_b_is_the_unfused_model_bit_for_bit(name):
  """B = 0: the logits are the Q8_0 model's loaded unfused (q | k | v split for their adapters,
  gate and up as two stacks: the load-fused gate | up stack split back by columns, the same int8
  values and scales), bit for bit; one adapter per expert, and only the targeted stacks have
  one."""
  targets = ["attn_q", "attn_k", "attn_v", "ffn_up_exps"]
  m = base(name).with_lora(rank=4, alpha=8.0, targets=targets)
  np.testing.assert_array_equal(m.logits(ids(name)), base(name, fuse=False).logits(ids(name)))
  assert not m.config.expert_fused_gate_up and m.lora.targets == tuple(targets)
  moe = m.params["layers"]["moe"]
  assert sorted(k for k in moe if "lora" in k) == ["up_exps_lora_a", "up_exps_lora_b"]
  c = m.config
  a, b = m.adapters()["blk.1.ffn_up_exps.weight"]
  assert a.shape == (c.experts, c.dim, 4) and b.shape == (c.experts, 4, c.expert_ffn)
  assert not b.any() and all(np.abs(a[e]).max() > 0 for e in range(c.experts))
  assert not np.array_equal(a[0], a[1])  # each expert initialized on its own


@pytest.mark.parametrize("name", matrix(["qwen3moe", "mixtral"], "qwen3moe"))
def test_expert_adapters_against_float64(name):
  """Each routed row goes through its expert's adapter: within 1e-5 per position of the float64
  forward of the Q8_0 values plus each expert's delta (measured 1.1e-6 on qwen3moe)."""
  m = adapted(name)
  want = reference(tiny(name), m.adapters(), 8.0 / 4, ids(name))
  assert rel_l2(m.logits(ids(name)), want).max() < 1e-5
  assert np.median(rel_l2(base(name).logits(ids(name)), want)) > 0.05  # the adapters matter


def test_adapter_file_is_llama_cpps_expert_layout(tmp_path):
  """`save_lora_gguf` writes an expert stack's pair as ggml [n_in, rank, n_expert] and
  [rank, n_out, n_expert]; read back, and `load_gguf(lora=)` serves it as the trained model."""
  m = adapted("qwen3moe")
  path = m.save_lora_gguf(tmp_path / "a.gguf")
  shapes = {t.name: t.shape.tolist() for t in gguf.GGUFReader(path).tensors}
  c = m.config
  assert shapes["blk.0.ffn_gate_exps.weight.lora_a"] == [c.dim, 4, c.experts]
  assert shapes["blk.0.ffn_gate_exps.weight.lora_b"] == [4, c.expert_ffn, c.experts]
  assert shapes["blk.1.ffn_down_exps.weight.lora_a"] == [c.expert_ffn, 4, c.experts]
  assert shapes["blk.1.ffn_down_exps.weight.lora_b"] == [4, c.dim, c.experts]
  back = read_lora_gguf(path)
  for name, (a, b) in m.adapters().items():
    np.testing.assert_array_equal(back.adapters[name][0], a)
    np.testing.assert_array_equal(back.adapters[name][1], b)
  loaded = load_gguf(tiny("qwen3moe"), dtype=jnp.float32, lora=path, progress=False)
  assert set(loaded.lora.targets) == {"attn_q", *EXPERTS}
  np.testing.assert_array_equal(loaded.logits(ids("qwen3moe")), m.logits(ids("qwen3moe")))


@pytest.mark.parametrize("name", matrix(["qwen3moe", "mixtral"], "mixtral"))
def test_llama_cpp_applies_our_expert_adapter_as_we_do(tmp_path, name):
  """Our adapter file in llama.cpp: on the F32 file its logits are the float64 forward of the
  F32 weights plus each expert's delta within 1e-5 per position (measured 7.5e-7 on qwen3moe),
  so it reads the layout as we write it; on the Q8_0 file (where llama.cpp also quantizes the
  activations) it is no farther from ours than without the adapter (median per position; 0.018
  against 0.024 on qwen3moe), while the adapter moved its logits far more than that."""
  m = adapted(name)
  lora = m.save_lora_gguf(tmp_path / "a.gguf")
  t = ids(name)
  f32 = llama_logits(tiny(name, "f32"), t, lora)
  assert rel_l2(f32, reference(tiny(name, "f32"), m.adapters(), 2.0, t)).max() < 1e-5
  q8_lora, q8_base = llama_logits(tiny(name), t, lora), llama_logits(tiny(name), t)
  lora_gap = np.median(rel_l2(m.logits(t), q8_lora))
  base_gap = np.median(rel_l2(base(name).logits(t), q8_base))
  assert lora_gap <= 1.5 * base_gap, (lora_gap, base_gap)
  assert np.median(rel_l2(q8_base, q8_lora)) > 5 * lora_gap


@pytest.mark.slow
@pytest.mark.heavy
def test_gemma4_fused_gate_up_stack_adapter_in_llama_cpp(tmp_path):
  """Gemma 4's file stores gate | up as one `ffn_gate_up_exps` stack: its adapter is on that
  stack, as llama.cpp applies one to the fused product; ffn_down_exps, whose per-expert scale
  llama.cpp applies before adding the adapter's delta (and q8rules after), is refused."""
  name = "gemma4-moe"
  m = base(name).with_lora(rank=4, alpha=8.0, targets=["ffn_gate_up_exps"])
  t = ids(name)
  np.testing.assert_array_equal(m.logits(t), base(name).logits(t))
  m = random_b(m, seed=3)
  lora = m.save_lora_gguf(tmp_path / "a.gguf")
  q8_lora, q8_base = llama_logits(tiny(name), t, lora), llama_logits(tiny(name), t)
  lora_gap = np.median(rel_l2(m.logits(t), q8_lora))
  base_gap = np.median(rel_l2(base(name).logits(t), q8_base))
  assert lora_gap <= 1.5 * base_gap, (lora_gap, base_gap)
  assert np.median(rel_l2(q8_base, q8_lora)) > 5 * lora_gap
  with pytest.raises(ValueError, match=r"ffn_down_exps on a model with a per-expert"):
    base(name).with_lora(rank=4, alpha=8.0, targets=["ffn_down_exps"])
  c = base(name).config
  rng = np.random.default_rng(0)
  down = {
    "blk.0.ffn_down_exps.weight": (
      rng.standard_normal((c.experts, c.expert_ffn, 4)).astype(np.float32),
      rng.standard_normal((c.experts, 4, c.dim)).astype(np.float32),
    )
  }
  path = save_lora_gguf(tmp_path / "down.gguf", down, arch="gemma4", alpha=4.0)
  with pytest.raises(CheckpointError, match=r"ffn_down_exps on a model with a per-expert"):
    load_gguf(tiny(name), lora=path, progress=False)


@pytest.mark.slow
def test_merged_expert_adapters_fuse_again():
  """`merged()` folds each expert's delta into its Q8_0 matrix (one more Q8_0 rounding) and fuses
  gate | up again, served as a plain Q8_0 model."""
  m = adapted("qwen3moe")
  merged = m.merged()
  assert merged.lora is None and merged.config.expert_fused_gate_up
  assert not any("lora" in k for k in merged.params["layers"]["moe"])
  want = reference(tiny("qwen3moe"), m.adapters(), 2.0, ids("qwen3moe"))
  assert np.median(rel_l2(merged.logits(ids("qwen3moe")), want)) < 2e-2


def test_expert_adapter_errors(tmp_path):
  """A per-expert pair for another expert count or width is refused naming the tensor; so are
  A and B of different expert counts, on write and on read."""
  c = base("qwen3moe").config
  rng = np.random.default_rng(1)

  def pair(e: int, k: int, n: int, r: int = 2):
    return rng.standard_normal((e, k, r)).astype(np.float32), np.zeros((e, r, n), np.float32)

  for bad in (pair(c.experts - 1, c.dim, c.expert_ffn), pair(c.experts, c.dim, c.expert_ffn + 1)):
    path = save_lora_gguf(
      tmp_path / "bad.gguf", {"blk.0.ffn_up_exps.weight": bad}, arch="qwen3moe", alpha=2.0
    )
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up_exps.weight'.*do not fit the base"):
      load_gguf(tiny("qwen3moe"), lora=path, progress=False)
  a, _ = pair(c.experts, c.dim, c.expert_ffn)
  _, b = pair(c.experts - 1, c.dim, c.expert_ffn)
  with pytest.raises(ValueError, match=r"of blk.0.ffn_up_exps.weight.*for a stack of experts"):
    save_lora_gguf(tmp_path / "x.gguf", {"blk.0.ffn_up_exps.weight": (a, b)}, arch="q", alpha=1)
  w = gguf.GGUFWriter(tmp_path / "mixed.gguf", "qwen3moe")
  w.add_string(gguf.Keys.General.TYPE, "adapter")
  w.add_string(gguf.Keys.Adapter.TYPE, "lora")
  w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 2.0)
  w.add_tensor("blk.0.ffn_up_exps.weight.lora_a", np.swapaxes(a, -1, -2).copy())
  w.add_tensor("blk.0.ffn_up_exps.weight.lora_b", np.swapaxes(b, -1, -2).copy())
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up_exps.weight'.*n_expert"):
    read_lora_gguf(tmp_path / "mixed.gguf")
