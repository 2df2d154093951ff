"""Converting LoRA adapters on a Q8_0 base: `merge_lora` (against a float64 merge requantized by
gguf.quants, bit for bit, and the Q8Provider's own quantization of it), `split_lora` /
`save_lora` / `load_lora` / `join_lora` (bit for bit), and the errors, linen and nnx."""

from __future__ import annotations

import flax.linen as nn
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import safetensors.numpy
from flax import nnx

import q8rules
from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import safetensors as q8_safetensors
from tests._utils import rel_err, weight64

K, H, D, OUT = 72, 4, 10, 48
"""up: einsum btd,dhk->bthk, weight (K, H, D): K = 72 (padded to 96), N = H * D = 40;
down: Dense (40, OUT): K = 40 (padded to 64), N = 48."""

N_UP = H * D
X_SHAPE = (2, 3, K)
RULES = [
  q8rules.Q8LoraRule(module_path="up", rank=4, alpha=6.0),
  q8rules.Q8LoraRule(module_path="down", rank=2, alpha=3.0),
]
SCALES = {"up/kernel": 6.0 / 4, "down/kernel": 3.0 / 2}
KN = {"up/kernel": (K, N_UP), "down/kernel": (N_UP, OUT)}


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Einsum((K, H, D), "btd,dhk->bthk", use_bias=False, name="up")(x)
    h = jnp.tanh(h.reshape(*h.shape[:-2], N_UP))
    return nn.Dense(OUT, use_bias=False, name="down")(h)


class NNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Einsum("btd,dhk->bthk", (K, H, D), rngs=rngs)
    self.down = nnx.Linear(N_UP, OUT, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = self.up(x)
    return self.down(jnp.tanh(h.reshape(*h.shape[:-2], N_UP)))


def _x(rng) -> jax.Array:
  return jnp.asarray(rng.standard_normal(X_SHAPE), jnp.float32)


def _ab(rng, name: str, rank: int) -> tuple[jax.Array, jax.Array]:
  """Fresh random A (K, r), B (r, N): the delta is about the weights' own size."""
  k, n = KN[name]
  a = rng.standard_normal((k, rank)) * 0.3
  b = rng.standard_normal((rank, n)) * 0.3
  return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def _value(v):
  return np.asarray(v[...] if isinstance(v, nnx.Variable) else v)


def _linen(rng, seed=0):
  """The adapted linen model and its params with fresh random adapters."""
  x = _x(rng)
  model = qwix.quantize_model(Net(), q8rules.Q8LoraProvider(RULES))
  params = model.init(jax.random.key(seed), x)["params"]
  params = {m: dict(v) for m, v in params.items()}
  for name, rank in (("up", 4), ("down", 2)):
    a, b = _ab(rng, f"{name}/kernel", rank)
    params[name]["kernel_lora_a"], params[name]["kernel_lora_b"] = a, b
  return model, params, x


def _plain_linen(x):
  """The plain Q8Provider model and its (freshly quantized) params."""
  model = qwix.quantize_model(Net(), q8rules.Q8Provider([q8rules.Q8Rule()]))
  return model, model.init(jax.random.key(9), x)["params"]


def _nnx(rng, lora_seed=1):
  x = _x(rng)
  provider = q8rules.Q8LoraProvider(RULES)
  model = qwix.apply_lora_to_model(NNet(nnx.Rngs(0)), provider, x, rngs=nnx.Rngs(lora_seed))
  for name, rank in (("up", 4), ("down", 2)):
    a, b = _ab(rng, f"{name}/kernel", rank)
    layer = getattr(model, name)
    layer.kernel_lora_a.value, layer.kernel_lora_b.value = a, b
  return model, x


def _plain_nnx(x):
  return qwix.quantize_model(NNet(nnx.Rngs(5)), q8rules.Q8Provider([q8rules.Q8Rule()]), x)


def _parts(tree, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(q, scale, A, B) of the layer `name` of a linen params dict or an nnx model."""
  if isinstance(tree, nnx.Module):
    layer = getattr(tree, name)
    q8 = layer.kernel.value.array
    a, b = layer.kernel_lora_a, layer.kernel_lora_b
  else:
    q8 = tree[name]["kernel"].array
    a, b = tree[name]["kernel_lora_a"], tree[name]["kernel_lora_b"]
  return _value(q8.q), _value(q8.scale), _value(a), _value(b)


def _float_merge(q, scale, a, b, s) -> np.ndarray:
  """The merge as documented: float64 q * d + s * A @ B, rounded once to float32, (K, N)."""
  k = a.shape[0]
  w = weight64(q, scale)[:k] + s * (a.astype(np.float64) @ b.astype(np.float64))
  return w.astype(np.float32)


def _gguf_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """gguf.quants' Q8_0 of a float32 (K, N) along K (padded with zeros): q (K_pad, N) int8 and
  the float16 scales (K_pad/32, N) it stores."""
  k, n = w.shape
  k_pad = -(-k // 32) * 32
  rows = np.zeros((n, k_pad), np.float32)
  rows[:, :k] = w.T
  raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0).reshape(n, k_pad // 32, 34)
  d = raw[..., :2].copy().view(np.float16)[..., 0]
  q = raw[..., 2:].copy().view(np.int8).reshape(n, k_pad)
  return q.T, d.T


def _forward64(x, w_up, w_down) -> np.ndarray:
  """float64 Net on (K, N) matrices: tanh(x @ W_up) @ W_down."""
  x2d = np.asarray(x, np.float64).reshape(-1, K)
  return np.tanh(x2d @ w_up) @ w_down


def _check_merged(merged_q8: dict, parts: dict, x, y_merged, y_adapted) -> float:
  """Each merged param is gguf.quants' Q8_0 of the float32 merge (q bit for bit, scales to
  float16); the merged model's output against float64 on its dequantised weights; the error
  against the adapted model's output (returned)."""
  deq = {}
  for name, (q, scale, a, b) in parts.items():
    mq, ms = merged_q8[name]
    w32 = _float_merge(q, scale, a, b, SCALES[f"{name}/kernel"])
    gq, gd = _gguf_q8_0(w32)
    assert mq.dtype == np.int8 and np.array_equal(mq, gq), name
    assert ms.dtype == np.float32 and np.array_equal(ms.astype(np.float16), gd), name
    assert not np.array_equal(mq, q), name  # the delta moved the values
    deq[name] = weight64(mq, ms)[: a.shape[0]]
  got = np.asarray(y_merged).reshape(-1, OUT)
  assert rel_err(got, _forward64(x, deq["up"], deq["down"])) < 2e-6
  return rel_err(got, np.asarray(y_adapted).reshape(-1, OUT))


@pytest.mark.slow
def test_linen_merge(rng):
  """merge_lora with the provider's rules: per-module alpha / rank; the merged params run in a
  plain Q8Provider model and equal its quantize_params of the float32 merge, bit for bit."""
  model, params, x = _linen(rng)
  merged = q8rules.merge_lora(params, q8rules.Q8LoraProvider(RULES))
  assert set(merged) == {"up", "down"} and all(set(v) == {"kernel"} for v in merged.values())
  plain, abstract = _plain_linen(x)
  y = plain.apply({"params": merged}, x)
  parts = {n: _parts(params, n) for n in ("up", "down")}
  mq = {
    n: (_value(merged[n]["kernel"].array.q), _value(merged[n]["kernel"].array.scale)) for n in parts
  }
  err = _check_merged(mq, parts, x, y, model.apply({"params": params}, x))
  print(f"linen merged vs adapted output: {err:.2e}")
  assert err < 2e-2, err

  floats = {
    "up": {"kernel": _float_merge(*parts["up"], SCALES["up/kernel"]).reshape(K, H, D)},
    "down": {"kernel": _float_merge(*parts["down"], SCALES["down/kernel"])},
  }
  fresh = q8rules.quantize_params(floats, abstract)
  for name in parts:
    for field in ("q", "scale"):
      want = _value(getattr(fresh[name]["kernel"].array, field))
      assert np.array_equal(_value(getattr(merged[name]["kernel"].array, field)), want)
  assert np.array_equal(np.asarray(plain.apply({"params": fresh}, x)), np.asarray(y))


def test_nnx_merge(rng):
  """nnx: the merged state (no LoRAParams) updates a plain Q8Provider model; the same numbers."""
  model, x = _nnx(rng)
  merged = q8rules.merge_lora(model, RULES)
  plain = _plain_nnx(x)
  nnx.update(plain, merged)
  assert not nnx.state(plain, nnx.LoRAParam)
  parts = {n: _parts(model, n) for n in ("up", "down")}
  mq = {
    n: (_value(merged[n]["kernel"]["array"]["q"]), _value(merged[n]["kernel"]["array"]["scale"]))
    for n in parts
  }
  err = _check_merged(mq, parts, x, plain(x), model(x))
  print(f"nnx merged vs adapted output: {err:.2e}")
  assert err < 2e-2, err


def test_split_save_load_join_linen(rng, tmp_path):
  """split -> save_lora -> load_lora is bit for bit (A, B, alpha); the base saved apart and the
  adapters joined onto it in a fresh model's params give the adapted outputs bit for bit; merging
  the loaded adapters into the base is merging them in place."""
  model, params, x = _linen(rng)
  provider = q8rules.Q8LoraProvider(RULES)
  base, adapters = q8rules.split_lora(params, provider)
  assert set(adapters) == {"up/kernel", "down/kernel"}
  assert all(set(v) == {"kernel"} for v in base.values())
  q8rules.save_lora(tmp_path / "lora.safetensors", adapters, {"note": "test"})
  with safetensors.safe_open(str(tmp_path / "lora.safetensors"), "numpy") as f:
    assert set(f.keys()) == {
      "up.kernel_lora_a",
      "up.kernel_lora_b",
      "down.kernel_lora_a",
      "down.kernel_lora_b",
    }
    assert f.metadata()["note"] == "test"
  loaded = q8rules.load_lora(tmp_path / "lora.safetensors")
  for name, adapter in adapters.items():
    got = loaded[name]
    assert got.alpha == adapter.alpha and got.rank == adapter.rank
    assert got.a.tobytes() == np.asarray(adapter.a).tobytes()
    assert got.b.tobytes() == np.asarray(adapter.b).tobytes()
  assert adapters["up/kernel"].a.tobytes() == np.asarray(params["up"]["kernel_lora_a"]).tobytes()

  q8_safetensors.save(tmp_path / "base.safetensors", base)
  fresh = model.init(jax.random.key(3), x)["params"]  # other random adapters
  base_again = q8_safetensors.load(tmp_path / "base.safetensors", like=base)
  joined = q8rules.join_lora(base_again, loaded, provider)
  want = model.apply({"params": params}, x)
  assert np.array_equal(np.asarray(model.apply({"params": joined}, x)), np.asarray(want))
  rejoined = q8rules.join_lora(fresh, loaded, provider)  # replaces the fresh adapters
  assert np.array_equal(
    np.asarray(rejoined["down"]["kernel_lora_b"]), np.asarray(params["down"]["kernel_lora_b"])
  )
  in_place = q8rules.merge_lora(params, RULES)
  from_file = q8rules.merge_lora(base_again, loaded)
  for a, b in zip(jax.tree.leaves(in_place), jax.tree.leaves(from_file), strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_split_save_load_join_nnx(rng, tmp_path):
  """nnx: the adapters of one model, saved and loaded, joined into a fresh adapted model (other
  random adapters) give its outputs bit for bit."""
  model, x = _nnx(rng)
  base, adapters = q8rules.split_lora(model, RULES)
  assert "kernel_lora_a" not in base["up"]
  q8rules.save_lora(tmp_path / "lora.safetensors", adapters)
  loaded = q8rules.load_lora(tmp_path / "lora.safetensors")
  fresh, _ = _nnx(np.random.default_rng(99), lora_seed=7)
  assert not np.array_equal(np.asarray(fresh(x)), np.asarray(model(x)))
  nnx.update(fresh, q8rules.join_lora(fresh, loaded, RULES))
  assert np.array_equal(np.asarray(fresh(x)), np.asarray(model(x)))


class TiedHead(nnx.Module):
  """A lookup and a tied head on one table (V, E): the head reads it as K = E, N = V."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(40, K, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(jnp.tanh(self.embed(ids)))


def test_tied_head_merge(rng):
  """The head's adapter is A (E, r), B (r, V) on the table's (K = E, N = V) matrix; merged, the
  one table serves the lookup and the head: the merged model equals float64 on the merged
  table for both."""
  ids = jnp.asarray(rng.integers(0, 40, (2, 5)), jnp.int32)
  provider = q8rules.Q8LoraProvider([q8rules.Q8LoraRule(rank=3, alpha=5.0)])
  model = qwix.apply_lora_to_model(TiedHead(nnx.Rngs(0)), provider, ids, rngs=nnx.Rngs(1))
  assert model.embed.embedding_lora_a.shape == (K, 3)
  a = jnp.asarray(rng.standard_normal((K, 3)) * 0.3, jnp.float32)
  b = jnp.asarray(rng.standard_normal((3, 40)) * 0.3, jnp.float32)
  model.embed.embedding_lora_a.value, model.embed.embedding_lora_b.value = a, b
  q8 = model.embed.embedding.value.array
  q, scale = _value(q8.q), _value(q8.scale)
  assert q.shape == (96, 40)
  merged = q8rules.merge_lora(model, provider)
  mq, ms = (_value(merged["embed"]["embedding"]["array"][f]) for f in ("q", "scale"))
  w32 = _float_merge(q, scale, np.asarray(a), np.asarray(b), 5.0 / 3)
  gq, gd = _gguf_q8_0(w32)
  assert np.array_equal(mq, gq) and np.array_equal(ms.astype(np.float16), gd)
  plain = qwix.quantize_model(TiedHead(nnx.Rngs(4)), q8rules.Q8Provider([q8rules.Q8Rule()]), ids)
  nnx.update(plain, merged)
  table = weight64(mq, ms)[:K]  # (E, V)
  h = np.tanh(table.T[np.asarray(ids)]).reshape(-1, K)
  err = rel_err(np.asarray(plain(ids)).reshape(-1, 40), h @ table)
  assert err < 2e-6, err


def test_float16_scales_and_device_kept(rng):
  """A param stored with float16 scales is merged with float16 scales (q from the float32
  scale, as llama.cpp), gguf.quants' bit for bit, on its device."""
  x = _x(rng)
  rules = [
    q8rules.Q8LoraRule(module_path="up", rank=4, alpha=6.0, scale_dtype="float16"),
    q8rules.Q8Rule(module_path="down"),
  ]
  model = qwix.quantize_model(Net(), q8rules.Q8LoraProvider(rules))
  params = model.init(jax.random.key(0), x)["params"]
  a, b = _ab(rng, "up/kernel", 4)
  params = {**params, "up": {**params["up"], "kernel_lora_a": a, "kernel_lora_b": b}}
  merged = q8rules.merge_lora(params, rules)
  q, scale, _, _ = _parts(params, "up")
  new = merged["up"]["kernel"].array
  assert new.scale.dtype == jnp.float16 and isinstance(new.q, jax.Array)
  assert new.q.sharding == params["up"]["kernel"].array.q.sharding
  gq, gd = _gguf_q8_0(_float_merge(q, scale, np.asarray(a), np.asarray(b), 1.5))
  assert np.array_equal(_value(new.q), gq) and np.array_equal(_value(new.scale), gd)
  assert merged["down"]["kernel"] is params["down"]["kernel"]


# ---- errors --------------------------------------------------------------------------------


def test_merge_errors(rng):
  model, params, x = _linen(rng)
  plain, q8_params = _plain_linen(x)
  with pytest.raises(ValueError, match=r"merge_lora: the params hold no LoRA adapter"):
    q8rules.merge_lora(q8_params, RULES)
  base, adapters = q8rules.split_lora(params, RULES)
  with pytest.raises(ValueError, match=r"ambiguous: .*up/kernel"):
    q8rules.merge_lora(params, adapters)
  with pytest.raises(ValueError, match=r"no LoRA adapter given"):
    q8rules.merge_lora(base, {})
  with pytest.raises(
    ValueError, match=r"LoRA adapter of down/kernel: no Q8LoraRule matches its module path 'down'"
  ):
    q8rules.merge_lora(params, RULES[:1])
  with pytest.raises(ValueError, match=r"down/kernel: the adapter has rank 2, .* rank \[5\]"):
    q8rules.merge_lora(
      params, [RULES[0], q8rules.Q8LoraRule(module_path="down", rank=5, alpha=1.0)]
    )
  two = [
    q8rules.Q8LoraRule(module_path="down", rank=2, alpha=1.0, op_names=("einsum",)),
    q8rules.Q8LoraRule(module_path=".*", rank=2, alpha=3.0),
  ]
  with pytest.raises(ValueError, match=r"down/kernel: ambiguous: .*alphas \[1.0, 3.0\]"):
    q8rules.merge_lora(params, [RULES[0], *two])
  wrong = {
    **adapters,
    "up/kernel": q8rules.LoraAdapter(
      a=adapters["up/kernel"].a[:64], b=adapters["up/kernel"].b, alpha=6.0
    ),
  }
  with pytest.raises(
    ValueError, match=r"up/kernel: LoRA A \(64, 4\) and B \(4, 40\) do not fit .*want A \(72, 4\)"
  ):
    q8rules.merge_lora(base, wrong)
  mixed = {
    "up/kernel": q8rules.LoraAdapter(
      a=adapters["up/kernel"].a, b=adapters["down/kernel"].b, alpha=6.0
    )
  }
  with pytest.raises(
    ValueError, match=r"up/kernel: LoRA A of shape \(72, 4\) and B of shape \(2, 48\)"
  ):
    q8rules.merge_lora(base, mixed)
  with pytest.raises(ValueError, match=r"LoRA adapter of mlp/kernel: the params hold no Q8 param"):
    q8rules.merge_lora(base, {"mlp/kernel": adapters["up/kernel"]})
  lone = {**params, "up": {k: v for k, v in params["up"].items() if k != "kernel_lora_b"}}
  with pytest.raises(
    ValueError, match=r"without their other half.*\n  up/kernel_lora_a without up/kernel_lora_b"
  ):
    q8rules.merge_lora(lone, RULES)
  with pytest.raises(TypeError, match=r"pass the nnx model itself"):
    q8rules.merge_lora(nnx.state(_nnx(rng)[0]), RULES)
  with pytest.raises(TypeError, match=r"Q8LoraProvider or a sequence of Q8Rules"):
    q8rules.split_lora(params, 2.0)
  bad = {
    **adapters,
    "up/kernel": q8rules.LoraAdapter(
      a=adapters["up/kernel"].a * np.float32(np.inf), b=adapters["up/kernel"].b, alpha=6.0
    ),
  }
  with pytest.raises(ValueError, match=r"cannot quantize up/kernel to Q8_0: it holds non-finite"):
    q8rules.merge_lora(base, bad)


def test_join_errors(rng):
  model, params, x = _linen(rng)
  base, adapters = q8rules.split_lora(params, RULES)
  other = [q8rules.Q8LoraRule(module_path="up", rank=4, alpha=2.0), RULES[1]]
  with pytest.raises(ValueError, match=r"LoRA adapter of up/kernel: its alpha 6.0 is not 2.0"):
    q8rules.join_lora(base, adapters, other)
  nmodel, _ = _nnx(rng)
  only_up = qwix.apply_lora_to_model(
    NNet(nnx.Rngs(0)),
    q8rules.Q8LoraProvider([RULES[0], q8rules.Q8Rule(module_path="down")]),
    x,
    rngs=nnx.Rngs(1),
  )
  with pytest.raises(
    ValueError, match=r"down/kernel: the nnx model has no LoRA param down/kernel_lora_a"
  ):
    q8rules.join_lora(only_up, adapters, RULES)
  _, nadapters = q8rules.split_lora(nmodel, RULES)
  for name in adapters:
    assert nadapters[name].a.shape == adapters[name].a.shape


def test_file_errors(rng, tmp_path):
  _, params, _ = _linen(rng)
  _, adapters = q8rules.split_lora(params, RULES)
  path = tmp_path / "lora.safetensors"
  with pytest.raises(CheckpointError, match=r"a path step is empty or holds '\.'"):
    q8rules.save_lora(path, {"up.proj/kernel": adapters["up/kernel"]})
  with pytest.raises(CheckpointError, match=r"reserved"):
    q8rules.save_lora(path, adapters, {"__q8rules_lora__": "x"})
  with pytest.raises(CheckpointError, match=r"LoRA adapter of up/kernel: LoRA B is float64"):
    q8rules.save_lora(
      path,
      {
        "up/kernel": q8rules.LoraAdapter(
          a=adapters["up/kernel"].a, b=adapters["up/kernel"].b.astype(np.float64), alpha=1.0
        )
      },
    )
  with pytest.raises(CheckpointError, match=r"alpha=0"):
    q8rules.save_lora(
      path,
      {
        "up/kernel": q8rules.LoraAdapter(
          a=adapters["up/kernel"].a, b=adapters["up/kernel"].b, alpha=0
        )
      },
    )
  q8rules.save_lora(path, adapters)
  with safetensors.safe_open(str(path), "numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = f.metadata()
  plain = tmp_path / "plain.safetensors"
  safetensors.numpy.save_file(tensors, str(plain))
  with pytest.raises(CheckpointError, match=r"not a LoRA file written by q8rules.save_lora"):
    q8rules.load_lora(plain)
  cut = tmp_path / "cut.safetensors"
  safetensors.numpy.save_file(
    {**tensors, "up.kernel_lora_b": tensors["up.kernel_lora_b"][:, :32]}, str(cut), meta
  )
  with pytest.raises(
    CheckpointError, match=r"up/kernel: tensor 'up.kernel_lora_b' is float32 \(4, 32\);.*\(4, 40\)"
  ):
    q8rules.load_lora(cut)
  missing = tmp_path / "missing.safetensors"
  safetensors.numpy.save_file(
    {k: v for k, v in tensors.items() if k != "down.kernel_lora_a"}, str(missing), meta
  )
  with pytest.raises(CheckpointError, match=r"down/kernel: tensor 'down.kernel_lora_a' is missing"):
    q8rules.load_lora(missing)
  extra = tmp_path / "extra.safetensors"
  safetensors.numpy.save_file(
    {**tensors, "mlp.kernel_lora_a": tensors["up.kernel_lora_a"]}, str(extra), meta
  )
  with pytest.raises(
    CheckpointError, match=r"tensors no adapter entry names:\n  mlp.kernel_lora_a"
  ):
    q8rules.load_lora(extra)
  # an adapter of another model's shapes, loaded and joined: named
  small = {
    "up/kernel": q8rules.LoraAdapter(
      a=np.ones((32, 4), np.float32), b=np.ones((4, 40), np.float32), alpha=6.0
    )
  }
  q8rules.save_lora(path, small)
  with pytest.raises(
    ValueError,
    match=r"up/kernel: LoRA A \(32, 4\) and B \(4, 40\) do not fit its Q8 weight \(float shape \(72, 4, 10\)",
  ):
    q8rules.join_lora(params, q8rules.load_lora(path), RULES)
