"""Token attributes as llama.cpp's `llama_vocab::impl::load` leaves them.

The file's `tokenizer.ggml.token_type` gives each token's attribute; llama.cpp then
changes some by their text (end-of-generation and fill-in-the-middle tokens become
control tokens, control tokens named 'unused' are also unused, ...) and, for some
models, strips the spaces around special tokens. These decide which tokens the
text is split on before tokenizing (special.py) and what `decode` prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from typing import Any

UNDEFINED = 0
UNKNOWN = 1 << 0
UNUSED = 1 << 1
NORMAL = 1 << 2
CONTROL = 1 << 3
USER_DEFINED = 1 << 4
BYTE = 1 << 5
LSTRIP = 1 << 7
RSTRIP = 1 << 8

FROM_TYPE = {0: UNDEFINED, 1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}
"""`tokenizer.ggml.token_type` (llama_token_type) -> attribute (llama_token_attr)."""

_EOT = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
_EOT += ("<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>")
_EOT += ("<end_of_utterance>",)
_FIM = {  # role -> texts llama.cpp recognizes when the file names no id for the role
  "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>")
  + ("▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
  "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>")
  + ("▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
  "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>")
  + ("▁<MID>", "<|code_middle|>", "<|middle|>"),
  "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
  "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
  "fim_sep": ("<|file_sep|>",),
}
_EOG = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>")
_EOG += ("<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>")
_EOG += ("_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>")
_EOG += ("<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def from_types(types: Sequence[int] | None, n: int) -> list[int]:
  """Attributes of n tokens from their `tokenizer.ggml.token_type` (all NORMAL if None)."""
  if types is None:
    return [NORMAL] * n
  return list(map(FROM_TYPE.get, map(int, list(types)[:n]), repeat(UNDEFINED)))


def _first(texts: Sequence[str], token_to_id: Mapping[str, int]) -> int | None:
  """The lowest id among `texts` (llama.cpp takes the first in its hash map's order)."""
  ids = [token_to_id[t] for t in texts if t in token_to_id]
  return min(ids) if ids else None


def mark_special(
  attrs: list[int], tokens: Sequence[str], token_to_id: Mapping[str, int], ids: dict[str, Any]
) -> set[int]:
  """llama.cpp's text-based control / unused / end-of-generation rules, in place.

  Args:
    attrs: per-token attributes (changed in place).
    tokens, token_to_id: the vocabulary.
    ids: special role -> id from the file (None where it has none); the roles 'eot',
      'eom' and 'fim_*' are filled in from the text rules, like llama.cpp.

  Returns:
    The end-of-generation token ids (llama.cpp's `special_eog_ids`).
  """
  for role, texts in (("eot", _EOT), ("eom", ("<|eom_id|>",)), *_FIM.items()):
    if ids.get(role) is None:
      ids[role] = found = _first(texts, token_to_id)
      if found is not None:
        attrs[found] |= CONTROL
  for i in compress(range(len(attrs)), map(CONTROL.__and__, attrs)):
    if "unused" in tokens[i]:
      attrs[i] |= UNUSED
  eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids.get(r) is not None}
  for text in _EOG:
    if text in token_to_id:
      eog.add(token_to_id[text])
      attrs[token_to_id[text]] |= CONTROL
  for text in _ALWAYS_USER:  # llama.cpp's gpt-oss rule
    if text in token_to_id:
      attrs[token_to_id[text]] = USER_DEFINED
  eog |= {ids[r] for r in ("eos", "eot", "eom") if ids.get(r) is not None}
  texts = {tokens[i]: i for i in eog if 0 <= i < len(tokens)}
  if "<|end|>" in texts and (
    {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
  ):
    eog.discard(texts["<|end|>"])
    attrs[texts["<|end|>"]] = USER_DEFINED
  if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
    eog.discard(texts["</s>"])
    attrs[texts["</s>"]] = NORMAL
  return eog


def special_ids(attrs: Sequence[int], tokens: Sequence[str]) -> list[int]:
  """Control, user-defined and unknown tokens, longest text (in bytes) first: the order
  llama.cpp splits the text on them (its sort is not stable; ties here go by id)."""
  ids = list(compress(range(len(attrs)), map((CONTROL | USER_DEFINED | UNKNOWN).__and__, attrs)))
  return sorted(ids, key=lambda i: -len(tokens[i].encode()))


def mark_strip(
  attrs: list[int],
  token_to_id: Mapping[str, int],
  specials: Sequence[int],
  *,
  name: str,
  pre: str,
  arch: str,
) -> None:
  """llama.cpp's per-model LSTRIP / RSTRIP rules (by general.name, tokenizer.ggml.pre and
  general.architecture), in place."""

  def set_attr(text: str, attr: int, on: bool) -> None:
    if text in token_to_id:
      i = token_to_id[text]
      attrs[i] = attrs[i] | attr if on else attrs[i] & ~attr

  name = name.encode().lower().decode()  # ASCII-only, as std::tolower
  if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
    s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
  ):
    set_attr("<mask>", LSTRIP, True)
  elif "phi-3" in name or "phi3" in name:
    for i in specials:
      attrs[i] |= RSTRIP
    set_attr("</s>", RSTRIP, True)
    for text in ("<unk>", "<s>", "<|endoftext|>"):
      set_attr(text, RSTRIP, False)
  elif "modern-bert" in name:
    set_attr("[MASK]", LSTRIP, True)
