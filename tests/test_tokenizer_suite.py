"""llama.cpp's tokenizer test suite on GGUFTokenizer: every `ggml-vocab-*.gguf` with `.inp` / `.out`.

Run as llama.cpp's tests/test-tokenizer-0.cpp runs it: the `.inp` texts split on
"\\n__ggml_vocab_test__\\n" (a trailing separator ends no case), one line of `.out`
ids per text, tokenized with add_special=false, parse_special=false. The files come
from scripts/fetch_llama_vocabs.py (cache: $Q8RULES_VOCAB_DIR, else
~/.cache/q8rules/llama-vocabs); without them the tests skip, unless
Q8RULES_REQUIRE_VOCABS=1, when they fail. Marked `tokenizer_suite` (not in the
default run): `pytest -m tokenizer_suite -rP tests/test_tokenizer_suite.py` prints
each vocabulary's count of cases passed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from q8rules.checkpoint import CheckpointError
from q8rules.llm.tokenizer import GGUFTokenizer

pytestmark = pytest.mark.tokenizer_suite

SUITE = ("bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4")
SUITE += ("gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact")
SUITE += ("starcoder",)
"""The vocabularies with test cases in llama-cpp-python 0.3.36's llama.cpp."""
NO_CASES = ("aquila", "baichuan", "gpt-neox")
"""Vocabularies shipped without cases (nomic-bert-moe, a T5 / Unigram one, is refused)."""

_SEP = "\n__ggml_vocab_test__\n"
_CLEANED = (" ?", " !", " .", " ,", " ' ", " 's", " 'm", " 're", " 've")
"""What llama.cpp's clean_spaces changes when it detokenizes."""


def vocab_dir() -> Path:
  env = os.environ.get("Q8RULES_VOCAB_DIR")
  d = Path(env) if env else Path.home() / ".cache" / "q8rules" / "llama-vocabs"
  if not (d / "ggml-vocab-llama-spm.gguf.inp").exists():
    message = f"no llama.cpp vocabularies in {d}: run scripts/fetch_llama_vocabs.py"
    if os.environ.get("Q8RULES_REQUIRE_VOCABS") == "1":
      pytest.fail(message + " (Q8RULES_REQUIRE_VOCABS=1)")
    pytest.skip(message)
  return d


def read_cases(gguf_path: Path) -> list[tuple[str, list[int]]]:
  """(text, ids) pairs of a vocabulary, split as test-tokenizer-0.cpp splits them."""
  raw = gguf_path.with_name(gguf_path.name + ".inp").read_bytes().decode("utf-8")
  texts, pos = [], 0
  while pos < len(raw):
    nxt = raw.find(_SEP, pos)
    if nxt < 0:
      texts.append(raw[pos:])
      break
    texts.append(raw[pos:nxt])
    pos = nxt + len(_SEP)
  lines = gguf_path.with_name(gguf_path.name + ".out").read_bytes().decode().split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  assert len(lines) == len(texts), f"{gguf_path}: {len(texts)} texts, {len(lines)} id lines"
  return [(t, [int(i) for i in line.split()]) for t, line in zip(texts, lines, strict=True)]


@pytest.fixture(scope="module")
def tokenizers():
  cache: dict[str, GGUFTokenizer] = {}

  def get(name: str) -> GGUFTokenizer:
    if name not in cache:
      cache[name] = GGUFTokenizer.from_gguf(vocab_dir() / f"ggml-vocab-{name}.gguf")
    return cache[name]

  return get


def test_the_suite_is_the_one_covered():
  have = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in vocab_dir().glob("*.inp")}
  assert have == set(SUITE), "the suite changed: add the new vocabularies here and check them"


@pytest.mark.parametrize("name", SUITE)
def test_cases(name, tokenizers):
  tok = tokenizers(name)
  cases = read_cases(vocab_dir() / f"ggml-vocab-{name}.gguf")
  failed = [
    (t, got, want) for t, want in cases if (got := tok.encode(t, add_special=False)) != want
  ]
  print(f"{name}: {len(cases) - len(failed)}/{len(cases)} cases")
  assert not failed, f"{name}: {len(failed)}/{len(cases)} failed, first: {failed[0]!r:.600}"


@pytest.mark.parametrize("name", [n for n in SUITE if n != "bert-bge"])
def test_decode_round_trips(name, tokenizers):
  """decode(encode(text)) == text wherever llama.cpp's detokenizer gives the text back: not
  WordPiece (it lowercases), not a text with what clean_spaces changes (with it on)."""
  tok = tokenizers(name)
  checked = 0
  for text, _ in read_cases(vocab_dir() / f"ggml-vocab-{name}.gguf"):
    if tok.vocab.clean_spaces and any(c in text for c in _CLEANED):
      continue
    for ids in (tok.encode(text), tok.encode(text, add_special=False)):
      assert tok.decode(ids) == text, (text, ids)
    checked += 1
  print(f"{name}: {checked} texts round-trip")
  assert checked >= 40


def test_special_ids_and_flags_of_the_files(tokenizers):
  spm, gemma, bert = tokenizers("llama-spm"), tokenizers("gemma-4"), tokenizers("bert-bge")
  assert (spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == (1, 2, True, False)
  assert spm.encode("Hello")[0] == 1 and spm.encode("Hello", add_special=False)[0] != 1
  assert gemma.add_bos and gemma.encode("Hi")[0] == gemma.bos_id == 2
  assert bert.encode("hi")[0] == 101 and bert.encode("hi")[-1] == 102  # [CLS] ... [SEP]
  assert tokenizers("llama-bpe").encode("Hi")[0] == 128000
  assert tokenizers("qwen2").encode("Hi") == tokenizers("qwen2").encode("Hi", add_special=False)
  assert 128009 in tokenizers("llama-bpe").eog_ids  # <|eot_id|>


@pytest.mark.parametrize("name", NO_CASES)
def test_vocabularies_without_cases_load_and_round_trip(name, recwarn):
  tok = GGUFTokenizer.from_gguf(vocab_dir() / f"ggml-vocab-{name}.gguf")
  warned = [str(w.message) for w in recwarn.list if "tokenizer.ggml.pre missing" in str(w.message)]
  assert bool(warned) == (tok.vocab.kind == "bpe")  # aquila / gpt-neox: BPE without a pre type
  text = "Hello world\n\tcafé 123"
  assert tok.decode(tok.encode(text)) == text


def test_unigram_vocabulary_is_refused():
  with pytest.raises(CheckpointError, match="nomic-bert-moe.gguf: tokenizer.ggml.model 't5'"):
    GGUFTokenizer.from_gguf(vocab_dir() / "ggml-vocab-nomic-bert-moe.gguf")
