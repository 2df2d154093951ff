"""gpt-oss files written independently of scripts/ (tests/gpt_oss_gguf_writer.py: gguf-py alone,
llama.cpp's converter's keys and layout, no `rope.dimension_count`, n_head * head_dim wider,
equal to and narrower than n_embd) against llama.cpp's logits and greedy tokens on them
(tests/data/gguf_models/independent-gpt-oss.npz, from scripts/make_gpt_oss_reference.py: an
F32 KV cache, flash attention off). The files are written here, at test time, and checked to
be the ones the reference was made from.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm import GGUFModel, load_gguf
from tests import gpt_oss_gguf_writer as writer
from tests._utils import matrix

REFS = Path(__file__).parent / "data" / "gguf_models" / "independent-gpt-oss.npz"
CASES = ("wide", "equal", "narrow")

VS_LLAMA_CPP = 1e-4
"""Bound of max over positions of max |ours - llama.cpp's| / max |llama.cpp's|, and of the
per-position relative L2 error (measured 4.4e-6 to 4.9e-6 and 3.7e-6 to 4.5e-6 on the three
cases; against llama.cpp with its default F16 KV cache the first is 3.4e-3 to 4.7e-3)."""


@functools.cache
def refs() -> dict[str, np.ndarray]:
  with np.load(REFS) as z:
    return {k: z[k] for k in z.files}


@functools.cache
def model(case: str, tmp: Path) -> GGUFModel:
  """The case's file, written now, loaded with float32 activations."""
  spec = writer.Spec(**json.loads(str(refs()[f"{case}_spec"])))
  sha = writer.weights_sha256(writer.weights(spec))
  if sha != str(refs()[f"{case}_weights_sha256"]):
    pytest.fail(
      f"tests/gpt_oss_gguf_writer.py no longer writes the weights {REFS.name} was made from"
      f" (case {case!r}): run scripts/make_gpt_oss_reference.py"
    )
  path = writer.write(tmp / f"independent-gpt-oss-{case}.gguf", spec)
  return load_gguf(path, dtype=jnp.float32, progress=False)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("independent-gpt-oss")


def test_the_cases_have_the_layouts_they_are_named_for(tmp):
  """wide / equal / narrow: n_head * head_dim against n_embd, read as the file says."""
  for case, relation in zip(CASES, (np.greater, np.equal, np.less), strict=True):
    c = model(case, tmp).config
    spec = writer.Spec(**json.loads(str(refs()[f"{case}_spec"])))
    assert (c.dim, c.heads, c.kv_heads, c.head_dim) == (
      spec.dim,
      spec.heads,
      spec.kv_heads,
      spec.head_dim,
    )
    assert relation(c.heads * c.head_dim, c.dim), case
    assert c.rope_scaling == "yarn" and c.rope_factor == spec.yarn_factor
    assert c.rope_original_context == spec.orig_ctx
    assert c.sliding_window == spec.window and c.attn_sinks
    assert c.local_layers == tuple(i % 2 == 0 for i in range(spec.layers))


@pytest.mark.parametrize("case", matrix(CASES, "wide"))
def test_logits_are_llama_cpps(case, tmp):
  """Every position of prompt + llama.cpp's greedy continuation (31 tokens, window 8)."""
  r = refs()
  ref = r[f"{case}_logits"].astype(np.float64)
  got = np.asarray(model(case, tmp).logits(r[f"{case}_tokens"][:-1].tolist()), np.float64)
  assert got.shape == ref.shape
  max_rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
  l2 = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
  assert max_rel.max() <= VS_LLAMA_CPP, (case, max_rel.max(), max_rel.argmax())
  assert l2.max() <= VS_LLAMA_CPP, (case, l2.max(), l2.argmax())


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_are_llama_cpps(case, tmp):
  """The decode loop (sinks and the sliding window in the one-token attention) continues
  the prompt with llama.cpp's greedy tokens."""
  r = refs()
  n = int(r[f"{case}_n_prompt"])
  tokens = r[f"{case}_tokens"].tolist()
  assert model(case, tmp).generate(tokens[:n], len(tokens) - n) == tokens[n:]


def test_the_spec_round_trips():
  """The npz's spec is the writer's `Spec` (a field renamed there fails here, not later)."""
  for case in CASES:
    fields = json.loads(str(refs()[f"{case}_spec"]))
    assert dataclasses.asdict(writer.Spec(**fields)) == fields
