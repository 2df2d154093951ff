"""`save_gguf` and `load_gguf(trainable='qat')` on the real, pretrained GGUF files
(scripts/fetch_real_models.py: SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M), and llama.cpp
(tests/_llamacpp.py) on the files written. Skipped without the files (as tests/test_real_gguf.py).
"""

from __future__ import annotations

import dataclasses
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q8rules
from q8rules.llm import load_gguf
from scripts.fetch_real_models import MODELS
from scripts.real_runs import TEXT
from tests._llamacpp import llama_logits
from tests.test_real_gguf import model_path
from tests.test_save_gguf import assert_same_params, flat, next_token_loss, read, rel_l2

pytestmark = pytest.mark.slow


HEAVY = [pytest.param(k, marks=pytest.mark.heavy) if k.startswith("gemma3") else k for k in MODELS]
"""Gemma 3 270M's cases take one to two minutes each: `heavy` (out of CI's slow step)."""


@pytest.mark.parametrize("key", HEAVY)
def test_round_trip_is_the_identity(tmp_path, key):
  """Saved without training: every tensor's data and type and every metadata key (tokenizer
  and chat template included) are the source's; `load_gguf` reads back the same params."""
  src = model_path(key)
  m = load_gguf(src, dtype=jnp.float32, progress=False)
  out = tmp_path / "out.gguf"
  m.save_gguf(out)
  assert read(out) == read(src)
  assert_same_params(load_gguf(out, dtype=jnp.float32, progress=False).params, m.params)


@pytest.mark.parametrize("key", HEAVY)
def test_qat_model_is_the_served_model(tmp_path, key):
  """trainable='qat': the logits over a real text equal the served model's to float32
  rounding (measured: bit-equal on both files, the same kernels on the same Q8_0 values);
  saved untrained, the file's tensors are the source's."""
  src = model_path(key)
  served = load_gguf(src, dtype=jnp.float32, progress=False)
  ids = served.tokenizer.encode(TEXT)
  ours = served.logits(ids)
  del served
  qat = load_gguf(src, dtype=jnp.float32, progress=False, trainable="qat")
  assert rel_l2(qat.logits(ids), ours) <= 1e-6
  qat.save_gguf(tmp_path / "out.gguf")
  assert read(tmp_path / "out.gguf") == read(src)


@pytest.mark.heavy
def test_qat_trained_file_runs_on_llama_cpp(tmp_path):
  """SmolLM2: two SGD steps of QAT on the first 64 tokens of a real text; the file written
  reads back as the trained weights' Q8_0 values, and llama.cpp's logits on it are as close
  to ours as on the source file (within 1.5 times)."""
  src = model_path("smollm2-q4_1")
  qat = load_gguf(src, dtype=jnp.float32, progress=False, trainable="qat")
  ids = qat.tokenizer.encode(TEXT)
  base = rel_l2(qat.logits(ids), llama_logits(src, ids))
  train = jnp.asarray(ids[:64], jnp.int32)[None]
  loss = jax.jit(jax.value_and_grad(lambda p: next_token_loss(qat, p, train)))
  params, losses = qat.params, []
  for _ in range(2):
    value, grads = loss(params)
    losses.append(float(value))
    params = jax.tree.map(lambda p, g: p - 0.02 * g, params, grads)
  del grads
  assert losses[1] < losses[0]
  trained = dataclasses.replace(qat, params=params)
  out = tmp_path / "trained.gguf"
  trained.save_gguf(out)
  ours = trained.logits(ids)

  back = load_gguf(out, dtype=jnp.float32, progress=False, trainable="qat")
  fake_quant = jax.jit(lambda v: q8rules.dequantize(q8rules.quantize(v, -2, jnp.float16)))
  got = flat(back.params)
  for k, v in flat(params).items():
    want = np.asarray(fake_quant(v)) if "kernel" in k or "table" in k else v
    np.testing.assert_array_equal(got[k], want, err_msg=k)
  del back, got
  assert rel_l2(ours, llama_logits(src, ids)) > 3 * base  # the training shows
  diff = rel_l2(ours, llama_logits(out, ids))
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"llama.cpp vs ours: source {base:.3g}, trained file {diff:.3g}; peak RSS {rss:.0f} MB")
  assert diff <= 1.5 * base, (diff, base)
