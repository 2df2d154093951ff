"""The README's first command, on a tiny configuration."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from q8rules.demo import main
from q8rules.kernels import resolve_product


@pytest.mark.slow
def test_demo_runs_and_reports(capsys):
  out = main(
    [
      "--layers",
      "1",
      "--dim",
      "128",
      "--ffn",
      "256",
      "--vocab",
      "256",
      "--steps",
      "3",
      "--repeats",
      "2",
    ]
  )
  text = capsys.readouterr().out
  assert "What matched and which path each op took" in text
  assert "layers/attn/o" in text and "lm_head" in text
  paths = out["report"].paths()
  # one decode token: what the dispatcher picks for this backend and shape
  assert paths["layers/mlp/down/dot_general0"] == resolve_product(1, 256, 128, jnp.float32)
  assert paths["layers/attn/einsum0"] == "float"  # scores: two activations, no weight
  assert paths["embed/take0"] == "lookup"  # the table is read from its Q8_0 values
  assert out["q8_bytes"] < 0.5 * out["float_bytes"]
  assert 0 < out["prefill_err"] < 0.05  # Q8_0 error against float: real but small


def test_implementation_choices_are_the_registered_ones():
  """`--implementation`'s choices (written out in `q8rules.demo_options`, which loads no JAX)
  are the Q8_0 product's registered implementations, in their order."""
  from q8rules.demo_options import IMPLEMENTATIONS
  from q8rules.kernels import IMPLEMENTATIONS as REGISTERED

  assert IMPLEMENTATIONS == REGISTERED
