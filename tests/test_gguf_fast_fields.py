"""FastReader (q8rules/checkpoint/gguf/fast_fields.py) reads every field as gguf.GGUFReader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from q8rules.checkpoint.gguf.fast_fields import FastReader

DATA = Path(__file__).parent / "data" / "gguf_models"


def same_fields(path):
  ours, theirs = FastReader(path, "r"), gguf.GGUFReader(path, "r")
  assert list(ours.fields) == list(theirs.fields)
  for key, want in theirs.fields.items():
    got = ours.fields[key]
    assert got.offset == want.offset and got.name == want.name, key
    assert got.types == want.types and got.data == want.data, key
    assert len(got.parts) == len(want.parts), key
    for a, b in zip(got.parts, want.parts, strict=True):
      assert a.dtype == b.dtype and np.array_equal(a, b), key
    assert got.contents() == want.contents(), key
  assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


@pytest.mark.parametrize("path", sorted(DATA.glob("*.gguf")), ids=lambda p: p.name)
def test_same_fields_as_gguf_reader(path):
  same_fields(path)


def test_long_and_empty_arrays(tmp_path):
  path = tmp_path / "arrays.gguf"
  w = gguf.GGUFWriter(path, "llama")
  w.add_array("t.strings", [f"tok{i}\u27e8" * (i % 3) for i in range(5000)])
  w.add_array("t.floats", [float(i) / 7 for i in range(5000)])
  w.add_array("t.ints", list(range(-20, 20)))
  w.add_array("t.empty_strings", [])
  w.add_array("t.nested", [[1, 2], [3]])
  w.add_string("t.after", "still read")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  w.close()
  same_fields(path)
