"""A GGUF vocabulary as llguidance's tokenizer (`LLTokenizer`), built once per tokenizer."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from q8rules.llm.tokenizer import GGUFTokenizer
from q8rules.llm.tokenizer.attrs import CONTROL, UNKNOWN, USER_DEFINED
from q8rules.llm.tokenizer.detok import piece

SPECIAL_PREFIX = b"\xff"
"""llguidance's mark of a special token's bytes: such a token matches only a grammar's
special-token reference, never text."""

_BUILT: weakref.WeakKeyDictionary[GGUFTokenizer, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def token_bytes(tokenizer: GGUFTokenizer) -> list[bytes]:
  """Each id's bytes (vocab_size entries): `token_to_piece`'s for text tokens; the marked text
  of control, unknown and `<...>` user-defined tokens (`SPECIAL_PREFIX` + text)."""
  vocab = tokenizer.vocab
  out = []
  for tid, (text, attr) in enumerate(zip(vocab.tokens, vocab.attrs, strict=True)):
    tagged = attr & USER_DEFINED and text.startswith("<") and text.endswith(">")
    if attr & (CONTROL | UNKNOWN) or tagged:
      out.append(SPECIAL_PREFIX + text.encode())
    else:
      out.append(piece(vocab, tid, special=False))
  return out


class _Wrapped:
  """What `llguidance.TokenizerWrapper` reads: ids' bytes, EOS/BOS and an encoder."""

  def __init__(self, tokenizer: GGUFTokenizer):
    if tokenizer.eos_id is None:
      raise ValueError(
        f"{tokenizer.vocab.path}: constrained output needs an EOS token; the file has none"
      )
    self.eos_token_id = tokenizer.eos_id
    self.bos_token_id = tokenizer.bos_id
    self.tokens = token_bytes(tokenizer)
    attrs = tokenizer.vocab.attrs
    self.special_token_ids = [i for i, a in enumerate(attrs) if a & CONTROL]
    self._tokenizer = tokenizer

  def __call__(self, text: str | bytes) -> list[int]:
    if isinstance(text, bytes):
      text = text.decode("utf-8", "replace")
    return self._tokenizer.encode(text, add_special=False)


def ll_tokenizer(tokenizer: GGUFTokenizer) -> Any:
  """`tokenizer`'s vocabulary as an `llguidance.LLTokenizer` (built on first use, ~0.1 s for
  a 49k vocabulary, then kept while the tokenizer lives)."""
  import llguidance

  with _LOCK:
    built = _BUILT.get(tokenizer)
    if built is None:
      built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tokenizer)))
      _BUILT[tokenizer] = built
    return built
