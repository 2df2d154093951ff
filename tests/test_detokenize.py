"""The one detokenizer (q8rules/engine/detokenize.py, `TextStream`) that `q8rules run`, `chat`
and `serve` stream their text through: its pieces join to the tokenizer's text of all the ids,
a character split across tokens is held back until whole, and a stop string ends the text
before it, its possible beginnings held back until they cannot be one."""

from __future__ import annotations

from pathlib import Path

import pytest

from q8rules.engine.detokenize import TextStream
from q8rules.llm.tokenizer.api import GGUFTokenizer

DATA = Path(__file__).parent / "data" / "gguf_models"
TEXT = "Héllo, wörld! 世界 🙂 -- the cat sat on the mat.\n  Twice:  the cat sat."


@pytest.fixture(scope="module", params=["tiny-llama-q8_0.gguf", "tiny-qwen2-q8_0.gguf"])
def tok(request):
  return GGUFTokenizer.from_gguf(DATA / request.param)


def pieces(tok, ids: list[int], stop: list[str]) -> tuple[list[str], bool]:
  text = TextStream(tok, stop)
  out, stopped = [], False
  for t in ids:
    piece, stopped = text.add(t)
    out.append(piece)
    if stopped:
      break
  out.append(text.flush())
  return out, stopped


def test_pieces_join_to_the_whole_text(tok, rng):
  ids = tok.encode(TEXT, add_special=False)
  out, stopped = pieces(tok, ids, [])
  assert "".join(out) == tok.decode(ids) and not stopped
  assert not any("\ufffd" in p for p in out)  # a character is sent whole
  vocab = len(tok.vocab.tokens)
  for _ in range(20):  # any ids, partial characters and control tokens included
    ids = [int(i) for i in rng.integers(0, vocab, 30)]
    assert "".join(pieces(tok, ids, [])[0]) == tok.decode(ids)


def test_a_stop_string_ends_the_text_before_it(tok):
  ids = tok.encode(TEXT, add_special=False)
  whole = tok.decode(ids)
  for stop in (["cat sat"], ["zzz", "wörld"], ["世界"], ["mat.\n"]):
    out, stopped = pieces(tok, ids, stop)
    first = min(whole.find(s) for s in stop if s in whole)
    assert stopped and "".join(out) == whole[:first]
  out, stopped = pieces(tok, ids, ["cat sit"])  # begins like the text, never matches
  assert not stopped and "".join(out) == whole


def test_a_possible_stop_string_is_held_back(tok):
  """While the text ends with a beginning of a stop string, that tail is not sent."""
  ids = tok.encode(TEXT, add_special=False)
  text = TextStream(tok, ["the cat sat on the rug"])
  sent = ""
  for t in ids:
    sent += text.add(t)[0]
    tail = text.text[len(sent) :]
    assert tail == "" or "the cat sat on the rug".startswith(tail)
    assert text.text.startswith(sent)
  assert sent + text.flush() == tok.decode(ids)


def test_no_tokenizer_gives_the_ids():
  text = TextStream(None, [])
  assert [text.add(t)[0] for t in (5, 17)] == [" 5", " 17"] and text.flush() == ""
