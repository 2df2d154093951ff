"""A GGUF vocabulary (`tokenizer.ggml.*`) read as llama.cpp's `llama_vocab::impl::load` reads it.

`Vocab.from_metadata` takes the file's key-value metadata (GGUFReader field contents,
or `GGUFCheckpoint.metadata`) and keeps what tokenizing and detokenizing need: the
tokens and their ids, scores, attributes (attrs.py), BPE merge ranks, the special
ids with llama.cpp's defaults per tokenizer model, and the flags (add BOS / EOS,
space prefix, ...) with llama.cpp's defaults where the file does not set them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from q8rules.checkpoint import CheckpointError
from q8rules.llm.tokenizer import attrs as A
from q8rules.llm.tokenizer.pre_types import DEFAULT, PRE_TOKENIZERS, PreTokenizer

KINDS = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe", "bert": "wpm"}
"""`tokenizer.ggml.model` -> the algorithm: SentencePiece BPE, byte-level BPE, WordPiece."""

_K = "tokenizer.ggml."
_ID_KEYS = {  # role -> metadata key of its id (llama.cpp's LLM_KV_TOKENIZER_*_ID)
  "bos": "bos_token_id",
  "eos": "eos_token_id",
  "eot": "eot_token_id",
  "eom": "eom_token_id",
  "unk": "unknown_token_id",
  "sep": "seperator_token_id",
  "pad": "padding_token_id",
  "mask": "mask_token_id",
  "fim_pre": "fim_pre_token_id",
  "fim_suf": "fim_suf_token_id",
  "fim_mid": "fim_mid_token_id",
  "fim_pad": "fim_pad_token_id",
  "fim_rep": "fim_rep_token_id",
  "fim_sep": "fim_sep_token_id",
}
_DEPRECATED = {"fim_pre": "prefix_token_id", "fim_suf": "suffix_token_id"}
_DEPRECATED["fim_mid"] = "middle_token_id"
_DEFAULT_IDS = {  # llama.cpp's special ids when the file names none
  "spm": {"bos": 1, "eos": 2, "unk": 0},
  "wpm": {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103},
  "bpe": {"bos": 11, "eos": 11},
}


@dataclasses.dataclass
class Vocab:
  """One vocabulary, as llama.cpp holds it after loading.

  Attributes:
    kind: 'spm', 'bpe' or 'wpm' (KINDS).
    tokens: token texts by id (an empty text is '[EMPTY_<id>]', as llama.cpp has it).
    token_to_id: text -> id (the last id of a repeated text).
    scores: float per token (SentencePiece merge priority; 0.0 when the file has none).
    attrs: llama_token_attr bits per token (attrs.py).
    ids: special role ('bos', 'eos', 'unk', 'sep', 'eot', 'fim_pre', ...) -> id or None.
    eog_ids: end-of-generation ids.
    specials: control / user-defined / unknown ids, longest text first.
    pre: the BPE pre-tokenizer (None for SPM and WordPiece).
    ranks: BPE merge 'left right' -> rank (the first of a repeated merge).
    add_bos, add_eos, add_space_prefix, clean_spaces, escape_whitespaces, ignore_merges,
    lowercase, strip_accents: llama.cpp's flags of the same names.
    max_token_len: the longest token, in characters.
    path: names the file in errors.
  """

  kind: str
  tokens: list[str]
  token_to_id: dict[str, int]
  scores: list[float]
  attrs: list[int]
  ids: dict[str, int | None]
  eog_ids: frozenset[int]
  specials: list[int]
  pre: PreTokenizer | None
  ranks: dict[str, int]
  add_bos: bool
  add_eos: bool
  add_space_prefix: bool
  clean_spaces: bool
  escape_whitespaces: bool
  ignore_merges: bool
  lowercase: bool
  strip_accents: bool
  max_token_len: int
  path: str

  @classmethod
  def from_metadata(cls, meta: Mapping[str, Any], *, path: str = "<gguf>") -> Vocab:
    """The vocabulary of a GGUF file's metadata; CheckpointError names `path` and the key."""
    model = meta.get(_K + "model")
    if model not in KINDS:
      raise CheckpointError(
        f"{path}: {_K}model {model!r} is not supported (supported: {sorted(KINDS)}:"
        " SentencePiece 'llama', byte-level BPE 'gpt2' / 'gemma4', WordPiece 'bert');"
        " pass token ids instead"
      )
    kind = KINDS[model]
    if _K + "tokens" not in meta:
      raise CheckpointError(f"{path}: no {_K}tokens (the vocabulary)")
    tokens = list(map(str, meta[_K + "tokens"]))
    if not all(tokens):  # llama.cpp names an empty token by its id
      tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    n = len(tokens)
    scores = _per_token(meta, "scores", n, path, float, 0.0)
    types = _per_token(meta, "token_type", n, path, int, 1)
    pre = _pre_tokenizer(meta, model, path) if kind == "bpe" else None
    ranks = _ranks(meta, pre, path) if pre is not None else {}
    flags = _flags(meta, kind, pre)
    token_to_id = dict(zip(tokens, range(n), strict=True))  # a repeated text: its last id
    attrs = A.from_types(types, n)
    ids = _special_ids(meta, kind, pre, n, path)
    eog = A.mark_special(attrs, tokens, token_to_id, ids)
    specials = A.special_ids(attrs, tokens)
    A.mark_strip(
      attrs,
      token_to_id,
      specials,
      name=str(meta.get("general.name", "")),
      pre=str(meta.get(_K + "pre", "")),
      arch=str(meta.get("general.architecture", "")),
    )
    return cls(
      kind=kind,
      tokens=tokens,
      token_to_id=token_to_id,
      scores=scores,
      attrs=attrs,
      ids=ids,
      eog_ids=frozenset(eog),
      specials=specials,
      pre=pre,
      ranks=ranks,
      max_token_len=max(map(len, tokens), default=0),
      path=path,
      **flags,
    )

  def byte_token(self, byte: int) -> int:
    """SentencePiece's token for one byte: '<0xXX>', else the byte itself (llama.cpp's
    `byte_to_token`); ValueError when the vocabulary has neither."""
    tid = self.token_to_id.get(f"<0x{byte:02X}>")
    if tid is None and byte < 0x80:
      tid = self.token_to_id.get(chr(byte))
    if tid is None:
      raise ValueError(f"{self.path}: the vocabulary has no token for byte 0x{byte:02X}")
    return tid


def _per_token(
  meta: Mapping[str, Any], key: str, n: int, path: str, cast: type, default: Any
) -> list[Any]:
  values = meta.get(_K + key)
  if values is None:
    return [default] * n
  values = list(values)
  if len(values) < n:
    raise CheckpointError(f"{path}: {_K}{key} has {len(values)} entries for {n} tokens")
  return list(map(cast, values[:n]))


def _pre_tokenizer(meta: Mapping[str, Any], model: str, path: str) -> PreTokenizer:
  name = "gemma4" if model == "gemma4" else meta.get(_K + "pre")
  if name is None or name not in PRE_TOKENIZERS:
    what = "missing" if name is None else f"{name!r} is not one llama.cpp knows"
    warnings.warn(
      f"{path}: {_K}pre {what}; using llama.cpp's default pre-tokenizer"
      " (token ids may differ from the model's own tokenizer)",
      stacklevel=4,
    )
    return DEFAULT
  return PRE_TOKENIZERS[name]


def _ranks(meta: Mapping[str, Any], pre: PreTokenizer, path: str) -> dict[str, int]:
  merges = meta.get(_K + "merges")
  if merges is None:
    if pre.kind == "kimi_k2":  # llama.cpp: Kimi-K2 has no merges
      return {}
    raise CheckpointError(f"{path}: BPE vocabulary without {_K}merges")
  ranks: dict[str, int] = {}
  for i, m in enumerate(merges):
    ranks.setdefault(str(m), i)
  return ranks


def _flags(meta: Mapping[str, Any], kind: str, pre: PreTokenizer | None) -> dict[str, bool]:
  f = dict(
    add_bos=kind != "bpe",
    add_eos=False,
    add_space_prefix=kind == "spm",
    clean_spaces=kind == "wpm",
    escape_whitespaces=True,
    ignore_merges=False,
    lowercase=True,
    strip_accents=True,
  )
  if pre is not None:
    f.update(
      add_bos=pre.add_bos,
      clean_spaces=pre.clean_spaces,
      escape_whitespaces=pre.escape_whitespaces,
      ignore_merges=pre.ignore_merges,
    )
  keys = {"add_space_prefix": "add_space_prefix", "add_bos": "add_bos_token"}
  keys.update(add_eos="add_eos_token", lowercase="normalizer.lowercase")
  for flag, key in keys.items():
    if _K + key in meta:
      f[flag] = bool(meta[_K + key])
  f["strip_accents"] = bool(meta.get(_K + "normalizer.strip_accents", f["lowercase"]))
  if pre is not None and pre.kind == "gemma4":
    f["add_bos"] = True  # llama.cpp overrides add_bos_token for Gemma 4
  return f


def _special_ids(
  meta: Mapping[str, Any], kind: str, pre: PreTokenizer | None, n: int, path: str
) -> dict[str, int | None]:
  ids: dict[str, int | None] = dict.fromkeys(_ID_KEYS)
  if not (pre is not None and pre.kind == "gemma4"):
    ids.update(_DEFAULT_IDS[kind])
  if pre is not None and pre.bos_null:
    ids["bos"] = None
  for role in ids:
    if ids[role] is not None and ids[role] >= n:  # a default out of range: none
      ids[role] = None
    for key in (_ID_KEYS[role], _DEPRECATED.get(role)):
      if key is not None and _K + key in meta:
        value = int(meta[_K + key])
        if 0 <= value < n:
          ids[role] = value
        else:
          warnings.warn(f"{path}: {_K}{key} = {value} is not a token id", stacklevel=5)
  return ids
