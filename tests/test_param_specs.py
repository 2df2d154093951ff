"""`param_specs.file_params` (the param tree `load_gguf` fills, built from the file's tensor
specs) against its reference `traced_params` (`jax.eval_shape` of the quantized model's init):
the same tree, aux data (each Q8 param's layout, dtypes and name) included, on every arch's
committed tiny file, Q8_0 and F32, fused and not, scanned and unrolled, in both dtypes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.checkpoint.gguf import open_gguf
from q8rules.llm import load as load_mod
from q8rules.llm.param_specs import file_params, traced_params
from q8rules.q8_0 import Q8Array

DATA = Path(__file__).parent / "data" / "gguf_models"
NAMES = (
  "llama",
  "qwen2",
  "llama31",
  "qwen3",
  "gemma",
  "gemma2",
  "gemma3",
  "phi3",
  "qwen3moe",
  "mixtral",
)


def both_trees(path: Path, *, dtype, fuse: bool) -> tuple:
  ckpt = open_gguf(path, scale_dtype=np.float16, progress=False)
  try:
    plan = load_mod.plan_load(ckpt, dtype=dtype, mesh=None, fuse=fuse)
    got = file_params(plan.tensors, plan.names, plan.q8_paths, plan.rule.scale_dtype)
    want = traced_params(plan.model, plan.provider, plan.config, plan.tensors, plan.names)
  finally:
    ckpt.close()
  return got, want, plan


def leaves(tree) -> list[tuple[str, tuple[int, ...], np.dtype]]:
  pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(p), tuple(x.shape), np.dtype(x.dtype)) for p, x in pairs]


def assert_same_tree(got, want) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want)  # aux data (Q8How, names) too
  assert leaves(got) == leaves(want)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("kind", ["q8_0", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_file_params_is_the_traced_tree(name, kind, fuse):
  got, want, plan = both_trees(DATA / f"tiny-{name}-{kind}.gguf", dtype=jnp.float32, fuse=fuse)
  assert_same_tree(got, want)
  q8 = [
    x
    for x in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, Q8Array))
    if isinstance(x, Q8Array)
  ]
  assert bool(q8) == (kind == "q8_0")  # the Q8_0 file's matrices are served, the F32 file's not
  assert plan.config.scan_layers


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3"])
def test_file_params_is_the_traced_tree_in_bfloat16(name):
  got, want, _ = both_trees(DATA / f"tiny-{name}-q8_0.gguf", dtype=jnp.bfloat16, fuse=True)
  assert_same_tree(got, want)


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_file_params_is_the_traced_tree_unrolled(name, monkeypatch):
  # a file whose block tensors change type across layers runs unrolled (layers_0, layers_1, ...)
  monkeypatch.setattr(load_mod, "uniform_across_layers", lambda ckpt, slots: False)
  got, want, plan = both_trees(DATA / f"tiny-{name}-q8_0.gguf", dtype=jnp.float32, fuse=True)
  assert not plan.config.scan_layers
  assert "layers_0" in got
  assert_same_tree(got, want)
