"""What a new user trips on: errors raised early and clearly, inputs accepted in the forms
the README shows."""

from __future__ import annotations

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import q8rules
from q8rules._qwix import WithAux

# ---- quantize: the axis --------------------------------------------------------------


@pytest.mark.parametrize(
  "shape, axis",
  [((64, 8), 2), ((64, 8), 5), ((64, 8), -3), ((32,), 1), ((2, 32, 4), -4)],
)
def test_quantize_refuses_an_axis_out_of_range(shape, axis):
  w = np.ones(shape, np.float32)
  with pytest.raises(ValueError) as e:
    q8rules.quantize(w, axis=axis, name="w")
  message = str(e.value)
  assert f"axis {axis} is out of range for rank {len(shape)}" in message
  assert str(shape) in message


@pytest.mark.slow
def test_quantize_accepts_every_axis_in_range():
  w = np.ones((32, 64, 96), np.float32)
  for axis in range(-3, 3):
    assert q8rules.quantize(w, axis=axis).axis == axis % 3


def test_quantize_refuses_a_non_int_axis():
  with pytest.raises(TypeError, match="axis must be an int"):
    q8rules.quantize(np.ones((32, 4), np.float32), axis=0.0)


# ---- quantize_params: the float tree's forms and its missing params --------------------


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(64, 96, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.down = nnx.Linear(96, 32, rngs=rngs)

  def __call__(self, x):
    return self.down(self.drop(jax.nn.relu(self.up(x)), deterministic=True))


@pytest.mark.parametrize("form", ["state", "param_state", "pure_dict"])
def test_quantize_params_takes_an_nnx_state(form):
  """`nnx.update(q8_model, quantize_params(float_state, q8_model))` as the README writes it."""
  x = jnp.ones((2, 64))
  float_model = Mlp(nnx.Rngs(0))
  q8_model = qwix.quantize_model(Mlp(nnx.Rngs(1)), q8rules.Q8Provider([q8rules.Q8Rule()]), x)
  float_state = {
    "state": lambda: nnx.state(float_model),
    "param_state": lambda: nnx.state(float_model, nnx.Param),
    "pure_dict": lambda: nnx.to_pure_dict(nnx.state(float_model, nnx.Param)),
  }[form]()
  nnx.update(q8_model, q8rules.quantize_params(float_state, q8_model))
  kernel = q8_model.up.kernel[...]
  assert isinstance(kernel, WithAux)
  want = q8rules.quantize(float_model.up.kernel[...], axis=0)
  np.testing.assert_array_equal(kernel.array.q, want.q)
  np.testing.assert_array_equal(kernel.array.scale, want.scale)
  np.testing.assert_array_equal(q8_model.down.bias[...], float_model.down.bias[...])


def test_quantize_params_names_a_missing_nnx_param():
  x = jnp.ones((2, 64))
  q8_model = qwix.quantize_model(Mlp(nnx.Rngs(1)), q8rules.Q8Provider([q8rules.Q8Rule()]), x)
  float_params = nnx.to_pure_dict(nnx.state(Mlp(nnx.Rngs(0)), nnx.Param))
  del float_params["down"]["kernel"]
  with pytest.raises(ValueError, match="lack 1 param.*:\n  down/kernel$"):
    q8rules.quantize_params(float_params, q8_model)


class Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="b")(nn.Dense(32, name="a")(x))


def test_quantize_params_names_missing_and_extra_linen_params():
  """At conversion time, not as Flax's ScopeParamNotFoundError at apply."""
  x = jnp.ones((2, 64))
  q8_model = qwix.quantize_model(Linen(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  abstract = jax.eval_shape(q8_model.init, jax.random.key(0), x)["params"]
  float_params = Linen().init(jax.random.key(0), x)["params"]
  renamed = {"a": float_params["a"], "c": float_params["b"]}  # a checkpoint with other names
  with pytest.raises(ValueError) as e:
    q8rules.quantize_params(renamed, abstract)
  message = str(e.value)
  assert "lack 2 param(s) of the quantized model:\n  b/bias\n  b/kernel\n" in message
  assert message.endswith(
    "2 float param(s) are not in the quantized model's params:\n  c/bias\n  c/kernel"
  )
  # allow_extra_params skips the extras, but a missing param is still an error (the extras
  # listed with it: they are most likely the missing ones under another name)
  with pytest.raises(ValueError, match="(?s)lack 2 param.*not in the quantized model.*c/bias"):
    q8rules.quantize_params(renamed, abstract, allow_extra_params=True)
  # the whole tree plus an extra converts with allow_extra_params
  extra = {**float_params, "unused": {"w": jnp.ones(3)}}
  params = q8rules.quantize_params(extra, abstract, allow_extra_params=True)
  assert set(params) == {"a", "b"}
  assert q8_model.apply({"params": params}, x).shape == (2, 16)


# ---- the demo's command line ------------------------------------------------------------


def test_demo_help_shows_every_option_and_its_default():
  out = subprocess.run(
    [sys.executable, "-c", "from q8rules.demo import main; main(['--help'])"],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert out.returncode == 0, out.stderr
  text = " ".join(out.stdout.split())
  for flag, default in (("--layers", 4), ("--dim", 512), ("--ffn", 1408), ("--vocab", 2048)):
    after = text.split(flag, 2)[-1]  # the option's own line, after its usage mention
    assert f"(default: {default})" in after.split("--", 1)[0], (flag, text)
