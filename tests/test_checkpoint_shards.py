"""Shard-wise reading (`GGUFCheckpoint.read_region`, `q8rules.checkpoint.shards`): a region is
the whole tensor's slice, read from only its bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint.gguf import open_gguf
from q8rules.checkpoint.shards import read_stacked_region, region_of
from q8rules.q8_0 import Q8Array

DATA = Path(__file__).parent / "data" / "gguf_models"
BLOCK_BYTES = 34


@pytest.mark.parametrize("layout", ["kernel", "gguf"])
def test_regions_are_slices_of_the_whole_tensor(layout):
  ckpt = open_gguf(DATA / "tiny-qwen2-q8_0.gguf", layout=layout)
  for name in ("blk.0.ffn_down.weight", "blk.1.attn_k.weight", "blk.0.attn_q.bias"):
    whole = ckpt[name]
    shape = whole.q.shape if isinstance(whole, Q8Array) else whole.shape
    blocked = len(shape) - (2 if layout == "kernel" else 1)
    for parts in (1, 2, 4):
      for axis in range(len(shape)):
        size = shape[axis] // parts
        if isinstance(whole, Q8Array) and axis == blocked and size % 32:
          continue
        for p in range(parts):
          index = [slice(None)] * len(shape)
          index[axis] = slice(p * size, (p + 1) * size)
          before = ckpt.bytes_read
          got = ckpt.read_region(name, tuple(index))
          want = region_of(whole, tuple(index))
          if isinstance(whole, Q8Array):
            np.testing.assert_array_equal(got.q, want.q)
            np.testing.assert_array_equal(got.scale, want.scale)
            assert ckpt.bytes_read - before == got.q.size // 32 * BLOCK_BYTES
          else:
            np.testing.assert_array_equal(got, want)
            assert ckpt.bytes_read - before == got.nbytes


def test_stacked_regions_and_a_cut_block():
  ckpt = open_gguf(DATA / "tiny-llama-q8_0.gguf")
  members = ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
  got = read_stacked_region(ckpt, members, (slice(1, 2), slice(128, 256), slice(0, 64)))
  want = ckpt["blk.1.ffn_down.weight"]
  np.testing.assert_array_equal(got.q[0], np.asarray(want.q)[128:256, :64])
  np.testing.assert_array_equal(got.scale[0], np.asarray(want.scale)[4:8, :64])
  with pytest.raises(CheckpointError, match=r"'blk.0.ffn_down.weight'.*rows 16:32 of K=256 cut"):
    ckpt.read_region("blk.0.ffn_down.weight", (slice(16, 32), slice(None)))
