"""`CheckpointReader`: every reader implements all of it, and a split GGUF set takes the same
one-pass stacked and fused reads as the single file (bit for bit, no tensor read on its own)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from q8rules.checkpoint import CheckpointError, gguf, safetensors
from q8rules.checkpoint.gguf.read import GGUFCheckpoint
from q8rules.checkpoint.gguf.split import GGUFSplitCheckpoint
from q8rules.checkpoint.host_buffers import is_aligned
from q8rules.checkpoint.reader import ArrayReader, CheckpointReader, as_reader
from q8rules.llm.stacked import StackedTensors
from q8rules.q8_0 import Q8Array
from tests.test_llm_gguf_errors import SRC, rewrite

READERS = [
  GGUFCheckpoint,
  GGUFSplitCheckpoint,
  safetensors.SafetensorsCheckpoint,
  ArrayReader,
  StackedTensors,
]


@pytest.mark.parametrize("cls", READERS, ids=lambda c: c.__name__)
def test_every_reader_implements_the_protocol(cls):
  assert issubclass(cls, CheckpointReader)
  assert not cls.__abstractmethods__, sorted(cls.__abstractmethods__)


def test_a_plain_mapping_reads_as_an_array_reader(rng):
  w = {"a": rng.standard_normal((4, 64)).astype(np.float32)}
  reader = as_reader(w)
  assert isinstance(reader, ArrayReader) and as_reader(reader) is reader
  assert reader.spec("a") == jax.ShapeDtypeStruct((4, 64), np.float32)
  np.testing.assert_array_equal(reader.read_region("a", (slice(1, 3),)), w["a"][1:3])
  np.testing.assert_array_equal(reader.get_stacked(["a", "a"]), np.stack([w["a"], w["a"]]))


def values_equal(a, b) -> bool:
  if isinstance(a, Q8Array) != isinstance(b, Q8Array):
    return False
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return all(
    x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    for x, y in zip(la, lb, strict=True)
  )


@pytest.fixture
def split_set(tmp_path):
  rewrite(tmp_path / "tiny.gguf", split_max_tensors=8)
  return tmp_path / "tiny-00001-of-00003.gguf"


def test_split_stacks_and_fusions_equal_the_single_files(split_set, monkeypatch):
  """Every stacked and fused slot of the scanned model, read from the 3-part set, equals the
  single file's bit for bit, and no Q8_0 tensor of a stack is read on its own (each part
  repacks its run of a stack in one pass)."""
  one = gguf.open_gguf(SRC)
  split = gguf.open_gguf(split_set)
  assert isinstance(split, GGUFSplitCheckpoint) and len(split.parts) == 3
  q8_stacks = [
    [f"blk.{i}.{m}.weight" for i in range(int(one.metadata["llama.block_count"]))]
    for m in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_down", "attn_output")
  ]
  owners = {id(split._part(n)) for g in q8_stacks for n in g}
  assert len(owners) > 1, "the stacks should span parts for this test to mean anything"
  singles = []
  real = GGUFCheckpoint.get_tensor
  monkeypatch.setattr(
    GGUFCheckpoint,
    "get_tensor",
    lambda self, name, **kw: singles.append(name) or real(self, name, **kw),
  )
  for names in q8_stacks:
    got = split.get_stacked(names)
    assert values_equal(got, one.get_stacked(names)), names[0]
    assert is_aligned(got.q) and is_aligned(got.scale)  # adopted by the CPU client, not copied
  fused = q8_stacks[:3]
  assert values_equal(split.get_fused(fused), one.get_fused(fused))
  assert singles == []
  assert split.bytes_read == one.bytes_read


def test_stacking_refuses_tensors_of_two_shapes():
  with gguf.open_gguf(SRC) as ckpt, pytest.raises(CheckpointError, match="2 shapes"):
    ckpt.get_stacked(["blk.0.attn_q.weight", "blk.0.ffn_down.weight"])


def test_safetensors_reader_regions(tmp_path, rng):
  """The safetensors reader reads regions of plain and Q8 tensors as the whole tensor sliced."""
  from q8rules import quantize

  w = quantize(rng.standard_normal((128, 48)).astype(np.float32))
  tree = {"layer": {"kernel": w, "bias": rng.standard_normal((48,)).astype(np.float32)}}
  path = tmp_path / "t.safetensors"
  safetensors.save(path, tree)
  with safetensors.SafetensorsCheckpoint(path) as reader:
    assert sorted(reader) == ["layer.bias", "layer.kernel"]
    whole = reader["layer.kernel"]
    region = reader.read_region("layer.kernel", (slice(32, 96), slice(8, 40)))
    np.testing.assert_array_equal(region.q, np.asarray(whole.q)[32:96, 8:40])
    np.testing.assert_array_equal(region.scale, np.asarray(whole.scale)[1:3, 8:40])
    spec = reader.spec("layer.kernel")
    assert spec.q.shape == (128, 48) and spec.scale.shape == (4, 48)
    bias = reader.read_region("layer.bias", (slice(4, 9),))
    np.testing.assert_array_equal(bias, tree["layer"]["bias"][4:9])


def test_split_stack_written_in_place_by_each_part(split_set, monkeypatch):
  """A stack whose layers span parts is one new array that each part's repack fills in place
  (no per-part array concatenated afterwards)."""
  from q8rules.checkpoint.gguf import split as split_module

  joined = []
  monkeypatch.setattr(split_module, "concat", lambda *a, **k: joined.append(a) or None)
  split = gguf.open_gguf(split_set)
  names = [f"blk.{i}.ffn_up.weight" for i in range(int(split.metadata["llama.block_count"]))]
  got = split.get_stacked(names)
  assert isinstance(got, Q8Array) and joined == []
  assert values_equal(got, gguf.open_gguf(SRC).get_stacked(names))
