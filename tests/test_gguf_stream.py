"""Stacks of expert tensors repacked run by run (`q8rules.checkpoint.gguf.stream`): the values of
the per-tensor reads, bit for bit, with one copy of the stack allocated and each run's file
pages released before the next run is read."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from q8rules.checkpoint.gguf import open_gguf, repack_sources, stream
from q8rules.checkpoint.gguf.header import open_file

LAYERS, EXPERTS, FFN, DIM = 3, 16, 128, 256
Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0


def expert_file(path: Path, qtype: gguf.GGMLQuantizationType) -> Path:
  """A GGUF file of LAYERS layers of expert stacks of `qtype` (random values): gate and up
  (EXPERTS, FFN, DIM), down (EXPERTS, DIM, FFN), numpy order."""
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(str(path), "llama")
  for i in range(LAYERS):
    for name, shape in (("gate", (FFN, DIM)), ("up", (FFN, DIM)), ("down", (DIM, FFN))):
      x = rng.standard_normal((EXPERTS, *shape), dtype=np.float32)
      blocks = gguf.quants.quantize(x, qtype)
      w.add_tensor(
        f"blk.{i}.ffn_{name}_exps.weight", blocks, raw_shape=blocks.shape, raw_dtype=qtype
      )
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def names(member: str) -> list[str]:
  return [f"blk.{i}.ffn_{member}_exps.weight" for i in range(LAYERS)]


@pytest.fixture(params=[Q8_0, Q4_0], ids=["q8_0", "q4_0-requantized"])
def ckpt(request, tmp_path):
  with open_gguf(expert_file(tmp_path / "experts.gguf", request.param)) as c:
    yield c


def test_stacks_and_fused_stacks_run_by_run_are_the_tensors_bit_for_bit(ckpt, monkeypatch):
  """Runs of 5 experts' bytes (cutting layers' experts apart): each stack is the tensors' own
  values stacked, the fused one the two stacks side by side along N."""
  one = {ckpt.gguf_shape(n): ckpt.raw(n).nbytes // EXPERTS for n in ckpt}
  monkeypatch.setattr(stream, "STREAM_BYTES", 5 * max(one.values()))
  tensors = {n: ckpt[n] for n in ckpt}
  for member in ("gate", "up", "down"):
    got = ckpt.get_stacked(names(member))
    assert got.q.shape == (LAYERS, *tensors[names(member)[0]].q.shape)
    np.testing.assert_array_equal(got.q, np.stack([tensors[n].q for n in names(member)]))
    np.testing.assert_array_equal(got.scale, np.stack([tensors[n].scale for n in names(member)]))
    assert got.axis == tensors[names(member)[0]].axis
  fused = ckpt.get_fused([names("gate"), names("up")])
  assert fused.q.shape == (LAYERS, EXPERTS, DIM, 2 * FFN)
  for part in ("q", "scale"):
    gate = np.stack([getattr(tensors[n], part) for n in names("gate")])
    up = np.stack([getattr(tensors[n], part) for n in names("up")])
    np.testing.assert_array_equal(getattr(fused, part), np.concatenate([gate, up], axis=-1))
  assert fused.axis == tensors[names("gate")[0]].axis


def test_a_fused_expert_stack_allocates_one_copy(ckpt):
  """The fused stack is written straight into one array: at most a little more than its bytes
  allocated while it is read (stacking each member, then concatenating, takes twice)."""
  ckpt.get_fused([names("gate"), names("up")])  # the native library loaded, caches warm
  tracemalloc.start()
  try:
    fused = ckpt.get_fused([names("gate"), names("up")])
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  nbytes = fused.q.nbytes + fused.scale.nbytes
  assert peak < 1.2 * nbytes, (peak, nbytes)


def test_each_run_is_released_before_the_next_is_read(tmp_path):
  """`stream.runs` hands out whole experts, about `run_bytes` a run, in file order, and releases
  a run's file bytes (all of them, once) when the caller is done with it."""
  path = expert_file(tmp_path / "experts.gguf", Q8_0)
  file = open_file(path)
  infos = [file.tensors[n] for n in names("gate")]
  one = infos[0].data.nbytes // EXPERTS

  def sources(t):
    return repack_sources.sources(
      [t], layout="kernel", scale_dtype=np.float16, byteorder="<", path=path
    )

  released: list[tuple[int, int]] = []
  seen = 0
  for run in stream.runs([infos], EXPERTS, sources, lambda a, b: released.append((a, b)), 3 * one):
    assert run.start == seen and run.stop - run.start == min(3, LAYERS * EXPERTS - seen)
    assert sum(r[1] - r[0] for r in released) == seen * one  # the runs before, and no more
    seen = run.stop
  assert seen == LAYERS * EXPERTS
  covered = sorted(released)
  assert covered[0][0] == infos[0].data_offset
  assert covered[-1][1] == infos[-1].data_offset + infos[-1].data.nbytes
  assert sum(b - a for a, b in covered) == LAYERS * EXPERTS * one
