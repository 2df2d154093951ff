"""A prompt chunk's attention over a long cache row (`q8rules.models.attention._global_read`):
it reads the shortest start of the row (`read_lengths`) that holds every key it sees, and its
output is the float64 softmax over exactly those keys, and the whole row's read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.models import TransformerConfig
from q8rules.models.attention import _attend_f32, _global_read, read_lengths
from tests._utils import rel_err

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32-accurate einsums on a GPU too

S = 8192
CONFIG = TransformerConfig(
  vocab=64, dim=32, layers=1, heads=4, kv_heads=2, head_dim=16, ffn=64, dtype=jnp.float32
)


def test_read_lengths():
  assert read_lengths(8192) == (1024, 2048, 4096, 8192)
  assert read_lengths(4096) == (1024, 2048, 4096)
  assert read_lengths(2048) == (1024, 2048)
  assert read_lengths(3072) == (3072,)  # 1536 is no whole multiple of 1024
  assert read_lengths(1000) == (1000,)


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: int) -> np.ndarray:
  """Causal softmax attention in float64 of q (T, heads, H) at `pos` over keys / values
  (S, kv_heads, H): (T, heads * H)."""
  t, heads, h = q.shape
  group = heads // keys.shape[1]
  out = np.zeros((t, heads, h))
  for i in range(t):
    seen = pos + i + 1
    for head in range(heads):
      k, v = keys[:seen, head // group], values[:seen, head // group]
      s = k @ q[i, head] / np.sqrt(h)
      p = np.exp(s - s.max())
      out[i, head] = p @ v / p.sum()
  return out.reshape(t, heads * h)


@pytest.mark.parametrize("pos", [0, 1016, 1017, 3000, S - 8])
def test_a_chunk_reads_what_the_row_holds(rng, pos):
  """Chunks of 8 tokens at positions where the shortest read is 1024, 2048 (1017 + 8 > 1024),
  4096 and the whole row: the float64 reference over [0, pos + 8), and the whole row's read
  (the keys past the chunk are masked out either way) within float32 rounding."""
  t = 8
  keys = rng.standard_normal((1, 1, S, 2, 16)).astype(np.float32)  # (layers, B, S, KV, H)
  values = rng.standard_normal((1, 1, S, 2, 16)).astype(np.float32)
  q = rng.standard_normal((1, t, 4, 16)).astype(np.float32)
  pair = (jnp.asarray(keys), jnp.asarray(values))
  read = jax.jit(lambda q, pair, pos: _global_read(CONFIG, q, pair, 0, pos))
  out = np.asarray(read(jnp.asarray(q), pair, jnp.int32(pos)))[0]
  want = reference(q[0].astype(np.float64), keys[0, 0], values[0, 0], pos)
  assert rel_err(out, want) < 1e-5
  visible = jnp.arange(S) <= (pos + jnp.arange(t))[:, None]
  whole = _attend_f32(CONFIG, jnp.asarray(q), pair[0][0], pair[1][0], visible)
  np.testing.assert_allclose(out, np.asarray(whole)[0], rtol=1e-5, atol=1e-6)
