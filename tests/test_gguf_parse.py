"""q8rules' GGUF header parser (q8rules/checkpoint/gguf/parse.py, header.py) against gguf-py.

`gguf.GGUFReader` is the reference: every field (value, type, item type) and every tensor
(name, type, shape, offset, the bytes, dtype and shape of its data view) of the test
models, of a file with every GGUF value type (little- and big-endian), and of hand-written
files with what `GGUFWriter` cannot write (empty arrays). Cut and corrupt headers raise
CheckpointError naming the file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFEndian
from gguf import GGUFValueType as V

from q8rules.checkpoint import CheckpointError
from q8rules.checkpoint import gguf as ckpt_gguf
from q8rules.checkpoint.gguf.header import open_file
from q8rules.checkpoint.gguf.layouts import block_dtype
from q8rules.checkpoint.gguf.metadata import field_value
from q8rules.checkpoint.gguf.parse import MAX_DEPTH, SCALAR_CODES, parse_header

DATA = Path(__file__).parent / "data" / "gguf_models"
MODELS = sorted(DATA.glob("*.gguf"))


def typed(v: Any) -> Any:
  """`v` with each scalar's Python type beside it (so 1, 1.0 and True differ)."""
  if isinstance(v, list):
    return [typed(x) for x in v]
  return (type(v).__name__, v)


def same_as_gguf_reader(path: Path, *, dequantize_other: bool = False) -> None:
  """The parser, `open_file` and `GGUFCheckpoint` give what `gguf.GGUFReader` gives."""
  ref = gguf.GGUFReader(path)
  header = parse_header(path.read_bytes(), path)
  assert header.version == ref.fields["GGUF.version"].contents()
  assert len(header.tensors) == ref.fields["GGUF.tensor_count"].contents()
  assert len(header.fields) == ref.fields["GGUF.kv_count"].contents()
  assert header.byteorder == ("<" if ref.endianess == GGUFEndian.LITTLE else ">")
  assert (header.alignment, header.data_start) == (ref.alignment, ref.data_offset)
  want = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
  assert list(header.fields) == list(want)
  ckpt = ckpt_gguf.load(path, dequantize_other=dequantize_other)
  metadata, typed_metadata = ckpt.metadata, ckpt.typed_metadata
  assert list(metadata) == list(want)
  for key, f in want.items():
    field = header.fields[key]
    value, gv = field_value(field)
    assert typed(value) == typed(f.contents()), key
    assert typed(metadata[key]) == typed(value) and typed_metadata[key] == gv, key
    if f.types[-1] == V.ARRAY:  # an empty array: gguf-py's types stop, ours say its item type
      assert field.types[: len(f.types)] == tuple(f.types) and len(field.types) == len(f.types) + 1
    else:
      assert field.types == tuple(f.types), key
      assert gv.sub_type == (f.types[-1] if f.types[0] == V.ARRAY else None), key
    assert gv.type == f.types[0] and field.type == f.types[0], key
  file = open_file(path)
  assert list(file.tensors) == [t.name for t in ref.tensors]
  for ours, theirs in zip(file.tensors.values(), ref.tensors, strict=True):
    assert ours.tensor_type == theirs.tensor_type, ours.name
    assert ours.shape == tuple(reversed(theirs.shape.tolist())) == ckpt.gguf_shape(ours.name)
    assert ours.data_offset == theirs.data_offset, ours.name
    for got in (ours.data, ckpt.raw(ours.name)):
      assert got.dtype == theirs.data.dtype and got.shape == theirs.data.shape, ours.name
      assert got.tobytes() == theirs.data.tobytes(), ours.name
      assert not got.flags.writeable
    assert ckpt.tensor_type(ours.name) == theirs.tensor_type


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_models_as_gguf_reader(path):
  same_as_gguf_reader(path)


# ---- a file with every GGUF value type, written by GGUFWriter ----------------------

SCALARS = {  # GGUF value type -> edge values
  V.UINT8: [0, 255],
  V.INT8: [-128, 127],
  V.UINT16: [0, 65535],
  V.INT16: [-32768, 32767],
  V.UINT32: [0, 2**32 - 1],
  V.INT32: [-(2**31), 2**31 - 1],
  V.FLOAT32: [0.1, -3.4e38, 1e-45],
  V.BOOL: [True, False],
  V.UINT64: [0, 2**64 - 1],
  V.INT64: [-(2**63), 2**63 - 1],
  V.FLOAT64: [0.1, -1e308, 5e-324],
}
UNICODE = ["", "a", "héllo", "⟨世界⟩", "🎉 emoji", "\u0120the", "<0x0A>", "x" * 300]


def every_type_tensors(rng, endianess: GGUFEndian) -> dict[str, tuple[np.ndarray, T | None]]:
  """name -> (array for GGUFWriter.add_tensor, raw type): every type `load` reads, and Q4_0."""
  w = rng.standard_normal((4, 64)).astype(np.float32)
  q8 = gguf.quants.quantize(w, T.Q8_0)
  if endianess == GGUFEndian.BIG:  # the scales in the file's byte order
    q8 = q8.reshape(-1).view(block_dtype("<")).astype(block_dtype(">")).view(np.uint8)
    q8 = q8.reshape(4, -1)
  bf16 = rng.standard_normal((2, 32)).astype(ml_dtypes.bfloat16).view(np.uint16)
  return {
    "f32": (rng.standard_normal((3, 64)).astype(np.float32), None),
    "f16": (rng.standard_normal((2, 32)).astype(np.float16), None),
    "f64": (rng.standard_normal(5), None),
    "i8": (rng.integers(-128, 128, 7).astype(np.int8), None),
    "i16": (rng.integers(-(2**15), 2**15, (2, 3)).astype(np.int16), None),
    "i32": (rng.integers(-(2**31), 2**31, 9).astype(np.int32), None),
    "i64": (rng.integers(-(2**62), 2**62, (3, 1)).astype(np.int64), None),
    "bf16": (bf16, T.BF16),
    "q8_0": (q8, T.Q8_0),
    "q4_0": (gguf.quants.quantize(w, T.Q4_0), T.Q4_0),
  }


def write_every_type(path: Path, rng, endianess: GGUFEndian) -> None:
  w = gguf.GGUFWriter(path, "llama", endianess=endianess)
  for vtype, values in SCALARS.items():
    for i, v in enumerate(values):
      w.add_key_value(f"s.{vtype.name}.{i}", v, vtype)
    w.add_key_value(f"a.{vtype.name}", values * 3, V.ARRAY, vtype)
  for i, s in enumerate(UNICODE):
    w.add_string(f"s.string.{i}", s)
  w.add_array("a.strings", UNICODE * 50)
  w.add_array("a.nested_ints", [[1, 2], [3], [4, 5, 6]])
  w.add_array("a.nested_strings", [["a", "é"], ["中", ""]])
  w.add_array("a.nested_floats", [[[1.5]], [[2.5, 3.5], [-0.25]]])
  w.add_custom_alignment(64)
  for name, (x, raw) in every_type_tensors(rng, endianess).items():
    big = GGUFEndian.BIG if x.dtype == np.uint8 else None  # raw bytes: already the file's
    w.add_tensor(name, x, raw_dtype=raw, tensor_endianess=big)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["le", "be"])
def test_every_value_type_as_gguf_reader(tmp_path, rng, endianess):
  path = tmp_path / "every.gguf"
  write_every_type(path, rng, endianess)
  same_as_gguf_reader(path, dequantize_other=True)
  fields = parse_header(path.read_bytes(), path).fields
  assert fields["general.alignment"].value == 64
  assert fields["a.nested_ints"].value == [[1, 2], [3], [4, 5, 6]]  # the nesting kept
  assert fields["a.nested_floats"].types == (V.ARRAY, V.ARRAY, V.ARRAY, V.FLOAT32)
  ckpt = ckpt_gguf.load(path, dequantize_other=True)
  assert ckpt.metadata["a.nested_strings"] == ["a", "é", "中", ""]  # flattened, as gguf-py
  assert ckpt.typed_metadata["a.nested_ints"] == gguf.GGUFValue(
    [1, 2, 3, 4, 5, 6], V.ARRAY, V.INT32
  )
  assert ckpt.metadata["s.FLOAT32.0"] == float(np.float32(0.1))
  assert ckpt.metadata["a.strings"][: len(UNICODE)] == UNICODE


def test_big_endian_tensors_read_as_little_endian(tmp_path):
  """The same tensors in a big-endian file load to the same (native-order) values."""
  le, be = tmp_path / "le.gguf", tmp_path / "be.gguf"
  write_every_type(le, np.random.default_rng(3), GGUFEndian.LITTLE)
  write_every_type(be, np.random.default_rng(3), GGUFEndian.BIG)
  a, b = (ckpt_gguf.load(p, dequantize_other=True) for p in (le, be))
  assert b.metadata == a.metadata and b.typed_metadata == a.typed_metadata
  for name in a:
    if name == "q4_0":  # gguf.quants reads quantized blocks in little-endian order only
      continue
    for layout in ("gguf", "kernel"):
      x, y = a.get_tensor(name, layout=layout), b.get_tensor(name, layout=layout)
      if isinstance(x, ckpt_gguf.read.Q8Array):
        np.testing.assert_array_equal(x.q, y.q)
        np.testing.assert_array_equal(x.scale.view(np.uint16), y.scale.view(np.uint16))
      else:
        assert x.dtype == y.dtype and x.dtype.isnative, name
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    region = (slice(0, 1),)
    x, y = a.read_region(name, region, layout="gguf"), b.read_region(name, region, layout="gguf")
    np.testing.assert_array_equal(np.asarray(getattr(x, "q", x)), np.asarray(getattr(y, "q", y)))


# ---- hand-written files: what GGUFWriter cannot write, and corrupt headers ---------


def pack(order: str, types: tuple[V, ...], value: Any) -> bytes:
  """A value's bytes (without its type): `types` as `Field.types`, e.g. (ARRAY, INT32)."""
  if types[0] == V.STRING:
    b = value.encode() if isinstance(value, str) else value
    return struct.pack(order + "Q", len(b)) + b
  if types[0] == V.ARRAY:
    head = struct.pack(order + "IQ", types[1], len(value))
    return head + b"".join(pack(order, types[1:], v) for v in value)
  return struct.pack(order + SCALAR_CODES[types[0]], value)


def gguf_bytes(
  fields: dict[str, tuple[tuple[V, ...], Any]],
  tensors: tuple[tuple[str, int, tuple[int, ...], int], ...] = (),
  *,
  order: str = "<",
  version: int = 3,
  data: bytes = b"",
) -> bytes:
  """A GGUF file: fields key -> (types, value); tensors (name, type id, ggml dims, offset)."""
  out = b"GGUF" + struct.pack(order + "IQQ", version, len(tensors), len(fields))
  for key, (types, value) in fields.items():
    out += pack(order, (V.STRING,), key) + struct.pack(order + "I", types[0])
    out += pack(order, types, value)
  for name, type_id, dims, offset in tensors:
    out += pack(order, (V.STRING,), name) + struct.pack(order + "I", len(dims))
    out += struct.pack(f"{order}{len(dims)}QIQ", *dims, type_id, offset)
  return out + bytes(-len(out) % 32) + data


EMPTY_ARRAYS = {
  "general.architecture": ((V.STRING,), "llama"),
  "e.ints": ((V.ARRAY, V.INT32), []),
  "e.strings": ((V.ARRAY, V.STRING), []),
  "e.nested": ((V.ARRAY, V.ARRAY, V.UINT8), [[], [1, 2]]),
  "e.nested_empty": ((V.ARRAY, V.ARRAY), []),  # no inner array to give an item type
  "after": ((V.STRING,), "still read"),
}


@pytest.mark.parametrize("order", ["<", ">"], ids=["le", "be"])
def test_empty_arrays_as_gguf_reader(tmp_path, order):
  path = tmp_path / "empty.gguf"
  data = np.arange(8, dtype=order + "f4").tobytes()
  path.write_bytes(gguf_bytes(EMPTY_ARRAYS, (("w", int(T.F32), (8,), 0),), order=order, data=data))
  same_as_gguf_reader(path)
  header = parse_header(path.read_bytes(), path)
  assert header.byteorder == order
  assert {k: f.types for k, f in header.fields.items()} == {
    k: t for k, (t, _) in EMPTY_ARRAYS.items()
  }
  assert header.fields["e.nested"].value == [[], [1, 2]]
  ckpt = ckpt_gguf.load(path)
  assert ckpt.typed_metadata["e.ints"] == gguf.GGUFValue([], V.ARRAY, V.INT32)
  assert ckpt.metadata["e.nested"] == [1, 2]
  np.testing.assert_array_equal(ckpt["w"], np.arange(8, dtype=np.float32))


def test_version_2_and_the_default_alignment(tmp_path):
  path = tmp_path / "v2.gguf"
  fields = {"general.architecture": ((V.STRING,), "llama"), "x": ((V.UINT32,), 7)}
  data = np.ones(4, np.float32).tobytes()
  path.write_bytes(gguf_bytes(fields, (("w", int(T.F32), (4,), 0),), version=2, data=data))
  same_as_gguf_reader(path)
  header = parse_header(path.read_bytes(), path)
  assert header.version == 2 and header.alignment == 32 and header.data_start % 32 == 0


def nested(depth: int) -> tuple[tuple[V, ...], list]:
  """An array of arrays `depth` deep, around one UINT8."""
  value: list = [1]
  for _ in range(depth - 1):
    value = [value]
  return (V.ARRAY,) * depth + (V.UINT8,), value


def bad_headers() -> dict[str, tuple[bytes, str]]:
  """case -> (a corrupt header, the error it gives after 'cannot read the GGUF header: ')."""
  one = {"k": ((V.UINT8,), 1)}
  array = {"k": ((V.ARRAY, V.UINT8), [1])}
  two = {"k": ((V.UINT8,), 1), "j": ((V.UINT8,), 2)}
  strings = {"k": ((V.ARRAY, V.STRING), [b"ok", b"\xe2\x82"])}
  align = "general.alignment"
  return {
    "version 1": (gguf_bytes({}, version=1), r"GGUF version 1 \(versions 2 and 3"),
    "unknown type": (
      gguf_bytes(one).replace(b"k\x00\x00\x00\x00", b"k\x0d\x00\x00\x00"),
      r"the value of key 'k': its type at byte \d+: unknown GGUF value type 13",
    ),
    "unknown item type": (
      gguf_bytes(array).replace(b"\x09\x00\x00\x00\x00", b"\x09\x00\x00\x00\x63"),
      r"the value of key 'k': its item type at byte \d+: unknown GGUF value type 99",
    ),
    "key not utf-8": (
      gguf_bytes({"kÿ": one["k"]}).replace("kÿ".encode(), b"k\xff\xbf"),
      r"the key of field 0 of 1 at byte \d+ is not UTF-8",
    ),
    "string not utf-8": (
      gguf_bytes({"k": ((V.STRING,), b"\xc3(")}),
      r"the value of key 'k' at byte \d+ is not UTF-8",
    ),
    "strings not utf-8": (
      gguf_bytes(strings),
      r"the value of key 'k' \(array of 2 STRING\) item 1 at byte \d+ is not UTF-8",
    ),
    "duplicate key": (gguf_bytes(two).replace(b"j", b"k"), "key 'k' appears twice"),
    "alignment type": (
      gguf_bytes({align: ((V.UINT64,), 32)}),
      "general.alignment is UINT64, not UINT32",
    ),
    "alignment 48": (
      gguf_bytes({align: ((V.UINT32,), 48)}),
      "general.alignment 48 is not a power of two",
    ),
    "alignment 0": (gguf_bytes({align: ((V.UINT32,), 0)}), "general.alignment 0 is not"),
    "duplicate tensor": (
      gguf_bytes({}, (("w", 0, (4,), 0), ("w", 0, (4,), 32))),
      "tensor 'w' appears twice in the tensor table",
    ),
    "nested too deep": (
      gguf_bytes({"k": nested(MAX_DEPTH + 2)}),
      rf"the value of key 'k' \(array of 1 ARRAY\)(\[0\]){{{MAX_DEPTH}}}: arrays nested more"
      f" than {MAX_DEPTH} deep",
    ),
    "huge array": (
      gguf_bytes(array).replace(
        b"k" + struct.pack("<IIQ", 9, 0, 1), b"k" + struct.pack("<IIQ", 9, 0, 2**62)
      ),
      r"the value of key 'k' \(array of 4611686018427387904 UINT8\) at byte \d+ runs past the end",
    ),
  }


BAD_HEADERS = bad_headers()


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_corrupt_headers(tmp_path, case):
  raw, pattern = BAD_HEADERS[case]
  path = tmp_path / "bad.gguf"
  path.write_bytes(raw + bytes(64))
  with pytest.raises(CheckpointError, match=r"bad\.gguf: cannot read the GGUF header: " + pattern):
    ckpt_gguf.load(path)
  assert nested(3) == ((V.ARRAY, V.ARRAY, V.ARRAY, V.UINT8), [[[1]]])


def test_a_cut_header_is_a_checkpoint_error(tmp_path):
  """A model's header cut at every byte: the parser names the file and what it was reading,
  and succeeds (with the same header) only once the tensor table is whole; `load` of files
  cut inside the header, its padding and the data: a CheckpointError naming the file."""
  src = DATA / "tiny-llama-q8_0.gguf"
  raw = src.read_bytes()
  whole = parse_header(raw, src)
  parsed = []
  for k in range(whole.data_start + 1):
    try:
      parsed.append(parse_header(raw[:k], "cut.gguf") == whole)
    except CheckpointError as e:
      assert not parsed, (k, str(e))  # once whole, it stays whole
      assert str(e).startswith("cut.gguf: "), (k, str(e))
      msg = "runs past the end of the file" if k >= 4 else "not a GGUF file"
      assert msg in str(e), (k, str(e))
  assert parsed and all(parsed)
  path = tmp_path / "cut.gguf"
  cuts = {*range(0, 40, 3), *np.linspace(40, whole.data_start + 64, 40).astype(int), len(raw) - 1}
  for k in sorted(cuts):
    path.write_bytes(raw[:k])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: "):
      ckpt_gguf.load(path)


def test_flipped_header_bytes_load_or_fail_cleanly(tmp_path, rng):
  """Random bytes of a model's header changed: `load` works or raises CheckpointError."""
  src = DATA / "tiny-qwen2-q8_0.gguf"
  raw = bytearray(src.read_bytes())
  start = parse_header(bytes(raw), src).data_start
  path = tmp_path / "flip.gguf"
  failed = 0
  for _ in range(150):
    bad = bytearray(raw)
    for at in rng.integers(4, start, 2):
      bad[at] = int(rng.integers(0, 256))
    path.write_bytes(bad)
    try:
      assert isinstance(ckpt_gguf.load(path).metadata, dict)
    except CheckpointError as e:
      assert "flip.gguf" in str(e)
      failed += 1
  assert failed  # some flips hit lengths, types or the tensor table
