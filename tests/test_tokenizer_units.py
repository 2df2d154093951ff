"""GGUFTokenizer's parts on tiny hand-built vocabularies (no download; the suite of llama.cpp's
own vocabularies is tests/test_tokenizer_suite.py). Expected ids are worked out by hand
from llama.cpp's algorithms (src/llama-vocab.cpp), step by step in the comments."""

from __future__ import annotations

import re
import unicodedata
import warnings

import gguf
import numpy as np
import pytest

from q8rules.checkpoint import CheckpointError
from q8rules.llm.tokenizer import PRE_TOKENIZERS, GGUFTokenizer, read_metadata
from q8rules.llm.tokenizer import split as S
from q8rules.llm.tokenizer import split_custom as SC
from q8rules.llm.tokenizer import unicode as U
from q8rules.llm.tokenizer.detok import _clean_spaces
from q8rules.llm.tokenizer.pre_types import DEFAULT, REGEXES

BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_meta(extra_tokens, *, types=None, **keys):
  """A SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, then `extra_tokens`
  ({text: score}); token_type 1 unless `types` ({text: type}) says otherwise."""
  texts = ["<unk>", "<s>", "</s>", *BYTES, *extra_tokens]
  base = {"<unk>": 2, "<s>": 3, "</s>": 3} | {b: 6 for b in BYTES} | (types or {})
  return {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": texts,
    "tokenizer.ggml.scores": [0.0] * 259 + list(extra_tokens.values()),
    "tokenizer.ggml.token_type": [base.get(t, 1) for t in texts],
    **{f"tokenizer.ggml.{k}": v for k, v in keys.items()},
  }


SPM = {"\u2581": -1, "a": -1, "b": -1, "c": -1, "\u2581a": -2, "ab": -0.5, "bc": -0.4}
SPM |= {"\u2581ab": -0.1, "abc": -3, "<|u|>": 0}


def ids(tok, *texts):
  return [tok.vocab.token_to_id[t] for t in texts]


def test_spm_merges_by_score_then_leftmost():
  tok = GGUFTokenizer.from_metadata(spm_meta(SPM, types={"<|u|>": 4}))
  # "▁abc▁ab": bc (-0.4) beats ab (-0.5) though ab is further left; the first ab is then
  # stale, the second merges, ▁+ab (-0.1), then ▁+a (-2); a+bc / ▁a+bc are no tokens.
  assert tok.encode("abc ab", add_special=False) == ids(tok, "\u2581a", "bc", "\u2581ab")
  assert tok.encode("abc ab") == [1, *ids(tok, "\u2581a", "bc", "\u2581ab")]  # BOS by default
  assert tok.decode(tok.encode("abc ab")) == "abc ab"
  # byte fallback: é is no token -> <0xC3> <0xA9>
  assert tok.encode("é", add_special=False) == ids(tok, "\u2581", "<0xC3>", "<0xA9>")
  assert tok.decode(tok.encode("é ab")) == "é ab"


def test_spm_special_tokens_and_flags():
  meta = spm_meta(SPM, types={"<|u|>": 4}, add_eos_token=True)
  tok = GGUFTokenizer.from_metadata(meta)
  u = tok.vocab.token_to_id["<|u|>"]
  # a user-defined token cuts the text; the text after it gets the space prefix again
  assert tok.encode("a<|u|>b", add_special=False) == [
    *ids(tok, "\u2581a"),
    u,
    *ids(tok, "\u2581", "b"),
  ]
  assert tok.encode("ab")[-1] == 2 and tok.encode("ab", add_eos=False)[-1] != 2
  # a control token is text unless parse_special
  plain = tok.encode("<s>", add_special=False)
  assert 1 not in plain and tok.decode(plain) == "<s>"
  assert tok.encode("<s>", add_special=False, parse_special=True) == [1]
  # special=True prints control tokens; BOS, not the text's "▁<", loses the leading space
  assert tok.decode([1, *plain, 2], special=True) == "<s> <s></s>"


def test_end_of_generation_texts_become_control_tokens():
  # llama.cpp makes "<|im_end|>" a control token (and end-of-generation) whatever its type
  tok = GGUFTokenizer.from_metadata(spm_meta({**SPM, "<|im_end|>": 0}, types={"<|im_end|>": 4}))
  end = tok.vocab.token_to_id["<|im_end|>"]
  assert end in tok.eog_ids and 2 in tok.eog_ids
  assert end not in tok.encode("a<|im_end|>")
  assert tok.encode("a<|im_end|>", parse_special=True)[-1] == end
  assert tok.decode([end]) == "" and tok.decode([end], special=True) == "<|im_end|>"


def test_phi3_strips_spaces_after_special_tokens():
  base = spm_meta(SPM, types={"<|u|>": 4})
  phi3 = GGUFTokenizer.from_metadata({**base, "general.name": "Phi3"})
  other = GGUFTokenizer.from_metadata(base)
  u = phi3.vocab.token_to_id["<|u|>"]
  assert phi3.encode("<|u|>  b", add_special=False) == [u, *ids(phi3, "\u2581", "b")]
  # without RSTRIP the two spaces stay: "▁" + "▁▁b"
  assert other.encode("<|u|>  b", add_special=False) == [u, *ids(other, *"\u2581" * 3, "b")]


def bpe_meta(tokens, merges, pre, **keys):
  byte_chars = list(U.BYTE_TO_UNICODE)
  return {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": pre,
    "tokenizer.ggml.tokens": byte_chars + tokens,
    "tokenizer.ggml.merges": merges,
    **{f"tokenizer.ggml.{k}": v for k, v in keys.items()},
  }


def test_bpe_merges_by_rank():
  merges = ["l l", "h e", "he ll", "hell o", "\u0120 hello"]
  tok = GGUFTokenizer.from_metadata(
    bpe_meta(["ll", "he", "hell", "hello", "\u0120hello"], merges, "gpt-2")
  )
  # "hello": ll (0) first, then he (1), he+ll (2), hell+o (3); " hello" also Ġ+hello (4)
  assert tok.encode("hello hello") == ids(tok, "hello", "\u0120hello")  # gpt-2: no BOS
  assert tok.decode(tok.encode("hello hello")) == "hello hello"
  # no merge for "x" + "y": one token per byte character
  assert tok.encode("xy") == ids(tok, "x", "y")


def test_ignore_merges_and_bos():
  tokens, merges = ["abc"], []
  llama = GGUFTokenizer.from_metadata(bpe_meta(tokens, merges, "llama-bpe", bos_token_id=5))
  gpt2 = GGUFTokenizer.from_metadata(bpe_meta(tokens, merges, "gpt-2", bos_token_id=5))
  assert llama.encode("abc") == [5, *ids(llama, "abc")]  # a word that is a token stays whole
  assert gpt2.encode("abc") == ids(gpt2, "a", "b", "c")
  assert gpt2.encode("abc", add_bos=True)[0] == 5


def test_unknown_or_missing_pre_falls_back_to_default():
  meta = bpe_meta([], [], "no-such-pre")
  with pytest.warns(UserWarning, match="no-such-pre"):
    tok = GGUFTokenizer.from_metadata(meta, path="x.gguf")
  assert tok.vocab.pre is DEFAULT
  del meta["tokenizer.ggml.pre"]
  with pytest.warns(UserWarning, match="missing"):
    assert GGUFTokenizer.from_metadata(meta).vocab.pre is DEFAULT


def test_gemma4_bpe_on_raw_utf8():
  tokens = ["<pad>", "<eos>", "<bos>", *BYTES, "\u2581", "a", "b", "\u2581b", "\n\n"]
  meta = {
    "tokenizer.ggml.model": "gemma4",
    "tokenizer.ggml.tokens": tokens,
    "tokenizer.ggml.merges": ["\u2581 b"],
    "tokenizer.ggml.token_type": [3, 3, 3, *[6] * 256, 1, 1, 1, 1, 1],
    "tokenizer.ggml.bos_token_id": 2,
    "tokenizer.ggml.add_bos_token": False,
  }
  tok = GGUFTokenizer.from_metadata(meta)
  # spaces -> ▁, split only at newline runs; "\n\n" is a token; c -> <0x63>; BOS forced
  want = [2, *ids(tok, "a", "\u2581b", "\n\n", "<0x63>")]
  assert tok.encode("a b\n\nc") == want
  assert tok.decode(want) == "a b\n\nc"


def test_wordpiece():
  tokens = ["[UNK]", "[CLS]", "[SEP]", "\u2581hello", "\u2581,", "\u2581wor", "ld", "\u2581x"]
  meta = {
    "tokenizer.ggml.model": "bert",
    "tokenizer.ggml.tokens": tokens,
    "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1, 1, 1],
    "tokenizer.ggml.unknown_token_id": 0,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.seperator_token_id": 2,
  }
  tok = GGUFTokenizer.from_metadata(meta)
  # lowercased, accent dropped, punctuation its own word; world = ▁wor + ld (longest
  # first); "!" and "xyz" (▁x then nothing for y) are unknown
  assert tok.encode("Héllo, WORLD! xyz") == [1, 3, 4, 5, 6, 0, 0, 2]
  assert tok.encode("Héllo", add_special=False) == [3]


def test_unsupported_model_is_refused():
  with pytest.raises(CheckpointError, match=r"m\.gguf: tokenizer\.ggml\.model 't5'"):
    GGUFTokenizer.from_metadata({"tokenizer.ggml.model": "t5"}, path="m.gguf")
  with pytest.raises(CheckpointError, match="merges"):
    GGUFTokenizer.from_metadata({**bpe_meta([], [], "gpt-2"), "tokenizer.ggml.merges": None})


def test_table_covers_llama_cpp_types():
  assert {p.kind for p in PRE_TOKENIZERS.values()} == set(REGEXES)
  assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and PRE_TOKENIZERS["llama-bpe"].add_bos
  assert not PRE_TOKENIZERS["qwen2"].clean_spaces and PRE_TOKENIZERS["gpt-2"].clean_spaces
  assert not PRE_TOKENIZERS["gemma4"].byte_encode and PRE_TOKENIZERS["gemma4"].escape_whitespaces
  assert PRE_TOKENIZERS["glm4"].bos_null
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # Python's re warns on what it would read differently
    for regexes, _ in REGEXES.values():
      for regex in regexes:
        if regex not in SC.CUSTOM:
          S.compiled(regex)


def test_collapsed_regex():
  assert S.collapse_regex(r"\p{L}+") == "[\xd2A-Za-z]+"
  assert S.collapse_regex(r"[^\s\p{N}]") == "[^\\s\xd10-9]"
  assert S.collapse_text("aé 中½\u3000") == "a\xd2 \xd2\xd1\x0b"
  # ECMAScript $ is the end of the piece only
  assert S.split_offsets("ab \n", [r"\s+$"]) == [2, 2]


@pytest.mark.parametrize("name", ["GPT2", "LLAMA3", "QWEN2", "QWEN35"])
def test_custom_splitters_equal_their_regex(name, rng):
  """llama.cpp's hand-written splitters against the same regex on Python's re (the
  collapsed-text path), on random text over letters, digits, marks, punctuation,
  symbols, ASCII and Unicode whitespace, CJK and emoji."""
  alphabet = list("abcXYZ019 \t\n\r'sStTdDmMlLvVrReE.,!?-_()") + list(
    "éж½\u0301😀\xa0\u3000中\x85ǅ™"
  )
  regex = getattr(SC, name)
  pattern, collapsed = S.compiled(regex)
  for _ in range(400):
    text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 24))))
    want = S._regex_offsets(S.collapse_text(text) if collapsed else text, pattern, [len(text)])
    assert SC.CUSTOM[regex](text, [len(text)]) == want, repr(text)


def test_other_custom_splitters():
  def pieces(text, regexes):
    return S.pre_split(text, regexes, byte_encode=False)

  assert pieces("x1234567y", [SC.TINY_AYA_DIGITS]) == ["x1", "234", "567", "y"]
  assert pieces("a\n\nb\n", [SC.NEWLINES]) == ["a", "\n\n", "b", "\n"]
  assert pieces("中文abc's 12345", [SC.KIMI_K2]) == ["中文", "abc's", " ", "123", "45"]
  assert pieces("12345", [SC.LLAMA3]) == ["123", "45"]
  assert pieces("12345", [SC.QWEN2]) == list("12345")
  assert pieces("cafe\u0301!", [SC.QWEN35]) == ["cafe\u0301", "!"]  # a mark joins its word
  assert pieces("cafe\u0301!", [SC.QWEN2]) == ["cafe", "\u0301!"]


def test_clean_spaces():
  assert _clean_spaces(b"a ? b ' c 's d 't e 're") == b"a? b'c's d 't e're"
  assert _clean_spaces(b"x ' ' y") == b"x'' y"  # llama.cpp zeroes the dropped space


def test_unicode_table_agrees_with_unicodedata():
  """llama.cpp's categories equal Python's wherever Python's Unicode assigns the codepoint."""
  cat = {"N": U.NUMBER, "L": U.LETTER, "Z": U.SEPARATOR, "M": U.MARK, "P": U.PUNCTUATION}
  cat |= {"S": U.SYMBOL, "C": U.CONTROL}
  for cp in range(0x110000):
    c = unicodedata.category(chr(cp))
    if c != "Cn":
      assert U.flags(chr(cp)) & U.CATEGORIES == cat[c[0]], hex(cp)
  assert U.flags("\u3000") & U.WHITESPACE and not U.flags("\x1c") & U.WHITESPACE
  assert U.tolower("\u0130") == "i" and U.nfd_first("é") == "e"


def test_read_metadata_equals_gguf_reader(tmp_path, rng):
  path = tmp_path / "v.gguf"
  w = gguf.GGUFWriter(path, "llama")
  words = ["".join(rng.choice(list("abcé中 "), size=int(rng.integers(1, 6)))) for _ in range(50)]
  w.add_tokenizer_model("llama")
  w.add_token_list(words)
  w.add_token_scores(rng.standard_normal(50).astype(np.float32).tolist())
  w.add_token_types(rng.integers(1, 7, 50).tolist())
  w.add_add_bos_token(True)
  w.add_bos_token_id(1)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  ref = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
  got = read_metadata(path)
  assert got == {k: v for k, v in ref.items() if re.match(r"tokenizer\.|general\.(name|arch)", k)}
  (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(40))
  with pytest.raises(CheckpointError, match="bad.gguf: not a GGUF file"):
    read_metadata(tmp_path / "bad.gguf")
