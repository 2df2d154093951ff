"""`load_gguf` on bad files: each a CheckpointError naming the file and the tensor; split sets."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from q8rules.checkpoint import CheckpointError
from q8rules.llm import load_gguf

DATA = Path(__file__).parent / "data" / "gguf_models"
SRC = DATA / "tiny-llama-q8_0.gguf"
IDS = [0, 41, 70, 77, 77, 80, 222, 88]


def rewrite(
  dst: Path,
  *,
  src: Path = SRC,
  drop: tuple[str, ...] = (),
  replace: dict | None = None,
  add: dict | None = None,
  meta: dict | None = None,
  typed_meta: dict | None = None,
  arch: str | None = None,
  split_max_tensors: int = 0,
) -> None:
  """Copy a GGUF file with gguf's reader and writer, changing what is asked.

  replace / add: name -> (float32 array in GGUF numpy order, GGML type); meta: key -> new value
  (same GGUF type as in the file); typed_meta: key -> (value, GGUFValueType, array item type or
  None), added or replacing.
  """
  r = gguf.GGUFReader(src)
  old_arch = r.fields["general.architecture"].contents()
  arch = arch or old_arch
  w = gguf.GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
  for key, field in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    vtype = V(field.types[0])
    sub = V(field.types[-1]) if vtype == V.ARRAY else None
    value = (meta or {}).get(key, field.contents())
    if key not in (typed_meta or {}):
      w.add_key_value(key.replace(old_arch + ".", arch + ".", 1), value, vtype, sub)
  for key, (value, vtype, sub) in (typed_meta or {}).items():
    w.add_key_value(key, value, vtype, sub)

  def put(name: str, x: np.ndarray, qtype: T) -> None:
    if qtype == T.F32:
      w.add_tensor(name, x.astype(np.float32))
    else:
      w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

  for t in r.tensors:
    if t.name in drop:
      continue
    if t.name in (replace or {}):
      put(t.name, *replace[t.name])
    else:
      w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
  for name, (x, qtype) in (add or {}).items():
    put(name, x, qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def file_weight(name: str) -> np.ndarray:
  for t in gguf.GGUFReader(SRC).tensors:
    if t.name == name:
      shape = tuple(int(d) for d in reversed(t.shape.tolist()))
      return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
  raise KeyError(name)


def raises(path: Path, *patterns: str, **kw) -> str:
  with pytest.raises(CheckpointError) as e:
    load_gguf(path, **kw)
  msg = str(e.value)
  assert str(path) in msg or path.name in msg, msg
  for p in patterns:
    assert re.search(p, msg), (p, msg)
  return msg


def test_missing_tensor(tmp_path):
  raises(rewrite_to(tmp_path, drop=("blk.1.ffn_up.weight",)), "missing", "'blk.1.ffn_up.weight'")


def test_unexpected_tensor(tmp_path):
  extra = {"blk.0.ffn_extra.weight": (np.ones((4, 32), np.float32), T.F32)}
  raises(rewrite_to(tmp_path, add=extra), "unexpected", "'blk.0.ffn_extra.weight'")


def test_shape_disagrees_with_metadata(tmp_path):
  msg = raises(
    rewrite_to(tmp_path, meta={"llama.feed_forward_length": 288}),
    "disagree with the metadata",
    r"'blk.0.ffn_up.weight': shape \(256, 128\), the metadata says \(288, 128\)",
  )
  assert "ffn 288" in msg


def test_unsupported_arch(tmp_path):
  raises(
    rewrite_to(tmp_path, arch="mamba"),
    "unsupported architecture 'mamba'",
    *("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"),
  )


def test_other_quant_type_requantized_or_dequantized(tmp_path):
  """A Q4_0 matrix is served as Q8_0 by default (its requantized blocks), as float32 with
  dequantize_other=True (with a warning naming it). (A type gguf.quants cannot dequantize is
  refused, named: tests/test_checkpoint_gguf.py.)"""
  w = file_weight("blk.0.ffn_up.weight")
  path = rewrite_to(tmp_path, replace={"blk.0.ffn_up.weight": (w, T.Q4_0)})
  served = load_gguf(path, dtype=jnp.float32)
  assert served.requantized == {"Q4_0": 1}
  q8_file = load_gguf(SRC, dtype=jnp.float32)  # the same model, all Q8_0: the same tree
  assert jax.tree.structure(served.params) == jax.tree.structure(q8_file.params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    m = load_gguf(path, dtype=jnp.float32, dequantize_other=True)
  assert any("'blk.0.ffn_up.weight': Q4_0" in str(c.message) for c in caught)
  up = m.params["layers_0"]["mlp"]["up"]["kernel"]
  assert np.asarray(up).dtype == np.float32 and up.shape == (128, 256)
  q8 = q8_file.logits(IDS)
  for q4 in (m.logits(IDS), served.logits(IDS)):
    assert np.linalg.norm(q4 - q8) / np.linalg.norm(q8) < 0.1


def test_truncated_file(tmp_path):
  path = tmp_path / "cut.gguf"
  data = SRC.read_bytes()
  path.write_bytes(data[: len(data) - 5000])
  raises(path, "truncated", "tensor '")


def rewrite_to(tmp_path: Path, name: str = "bad.gguf", **kw) -> Path:
  path = tmp_path / name
  rewrite(path, **kw)
  return path


def test_split_set_loads_as_one(tmp_path):
  rewrite(tmp_path / "tiny.gguf", split_max_tensors=8)
  parts = sorted(p.name for p in tmp_path.iterdir())
  assert parts == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)], parts
  m = load_gguf(tmp_path / parts[0], dtype=jnp.float32)
  want = load_gguf(SRC, dtype=jnp.float32).logits(IDS)
  np.testing.assert_array_equal(m.logits(IDS), want)
  assert m.tokenizer is not None and m.tokenizer.encode("Hello") == [0, 41, 70, 77, 77, 80]


def test_split_set_with_a_part_missing(tmp_path):
  rewrite(tmp_path / "tiny.gguf", split_max_tensors=8)
  (tmp_path / "tiny-00002-of-00003.gguf").unlink()
  raises(tmp_path / "tiny-00001-of-00003.gguf", "1 part\\(s\\) missing", "tiny-00002-of-00003.gguf")


@pytest.mark.slow
def test_a_tokenizer_that_cannot_be_built_does_not_block_the_weights(tmp_path, capsys):
  """An unknown tokenizer model: the model loads with `.tokenizer = None` and one warning
  saying why; logits and generate take ids, equal to the file's own; the CLI takes --ids and
  says so without them."""
  from q8rules.cli import main, parser
  from q8rules.cli import run as run_cmd

  path = rewrite_to(tmp_path, meta={"tokenizer.ggml.model": "no-such-tokenizer"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    m = load_gguf(path, dtype=jnp.float32)
  said = [str(w.message) for w in caught if "tokenizer" in str(w.message)]
  assert len(said) == 1 and "no-such-tokenizer" in said[0] and "token ids" in said[0], said
  assert m.tokenizer is None
  want = load_gguf(SRC, dtype=jnp.float32)
  np.testing.assert_array_equal(m.logits(IDS), want.logits(IDS))
  assert m.generate(IDS, 4) == want.generate(IDS, 4)
  ids = ",".join(map(str, IDS))
  out = run_cmd.execute(
    parser().parse_args(["run", str(path), "--ids", ids, "-n", "3", "--no-progress"])
  )
  assert out["new_ids"] == want.generate(IDS, 3)
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    main(["run", str(path), "--prompt", "Hello", "--no-progress"])
  assert e.value.code == 1 and "--ids" in capsys.readouterr().err


GEMMA2 = DATA / "tiny-gemma2-q8_0.gguf"
PHI3 = DATA / "tiny-phi3-q8_0.gguf"


def test_unsupported_rope_scaling_names_the_key(tmp_path):
  path = rewrite_to(tmp_path, typed_meta={"llama.rope.scaling.type": ("dynamic", V.STRING, None)})
  raises(path, "llama.rope.scaling.type 'dynamic' is not supported", "longrope, yarn")


def test_per_layer_head_counts_are_refused(tmp_path):
  counts = ([4, 4], V.ARRAY, V.UINT32)
  path = rewrite_to(tmp_path, typed_meta={"llama.attention.head_count_kv": counts})
  raises(path, "per-layer values of 'llama.attention.head_count_kv'")


def test_value_length_other_than_key_length(tmp_path):
  path = rewrite_to(tmp_path, typed_meta={"llama.attention.value_length": (16, V.UINT32, None)})
  raises(path, "llama.attention.value_length 16 differs from the key length 32")


def test_gemma2_with_an_output_matrix_is_refused(tmp_path):
  """Gemma's output is always the embedding table (llama.cpp reads no output.weight)."""
  out = {"output.weight": (np.ones((320, 64), np.float32), T.F32)}
  raises(rewrite_to(tmp_path, src=GEMMA2, add=out), "unexpected", "'output.weight'", "'gemma2'")


def test_phi3_missing_a_rope_factor_table(tmp_path):
  path = rewrite_to(tmp_path, src=PHI3, drop=("rope_factors_short.weight",))
  raises(path, "missing", "'rope_factors_short.weight'")


@pytest.mark.slow
def test_sliding_window_pattern_as_an_array(tmp_path):
  """The pattern key as per-layer bools (llama.cpp's array form): the file's own pattern
  written out loads to the same logits; all-global differs; a wrong length is refused."""
  key = "gemma2.attention.sliding_window_pattern"
  same = rewrite_to(
    tmp_path, "same.gguf", src=GEMMA2, typed_meta={key: ([1, 0, 1, 0], V.ARRAY, V.BOOL)}
  )
  flat = rewrite_to(tmp_path, "flat.gguf", src=GEMMA2, typed_meta={key: ([0] * 4, V.ARRAY, V.BOOL)})
  ids = list(range(3, 40))
  want = load_gguf(GEMMA2, dtype=jnp.float32).logits(ids)
  m = load_gguf(same, dtype=jnp.float32)
  assert m.config.local_layers == (True, False, True, False)
  np.testing.assert_array_equal(m.logits(ids), want)
  m = load_gguf(flat, dtype=jnp.float32)
  assert not any(m.config.local_layers)
  assert np.abs(m.logits(ids) - want).max() > 1e-3
  bad = rewrite_to(tmp_path, "bad.gguf", src=GEMMA2, typed_meta={key: ([1, 0], V.ARRAY, V.BOOL)})
  raises(bad, "sliding_window_pattern has 2 entries for 4 layers")
