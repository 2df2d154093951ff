"""llama.cpp's BPE pre-tokenizers as one table: `tokenizer.ggml.pre` -> `PreTokenizer`.

Transcribed from llama.cpp's src/llama-vocab.cpp (the `llm_tokenizer_bpe` regex lists
and the `tokenizer_pre` chain of `llama_vocab::impl::load`): each pre type's regexes
(run by split.py as llama.cpp runs them) and the flags its names set. A name missing
from the table falls back to llama.cpp's own default ('default': its regexes, its
flags) with a warning (llama.cpp refuses the file), as a missing
`tokenizer.ggml.pre` does in llama.cpp.
"""

from __future__ import annotations

import dataclasses

from q8rules.llm.tokenizer.split_custom import (
  AFMOE_DIGITS,
  GPT2,
  KIMI_K2,
  LLAMA3,
  NEWLINES,
  QWEN2,
  QWEN35,
  TINY_AYA_DIGITS,
)


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
  """How llama.cpp pre-tokenizes and post-processes one `tokenizer.ggml.pre` value.

  Attributes:
    kind: llama.cpp's pre type (`LLAMA_VOCAB_PRE_TYPE_<KIND>`, lowercased).
    regexes: applied one after the other, each splitting the pieces left so far.
    byte_encode: words as GPT-2 byte characters (False: raw UTF-8, '<0xXX>' byte tokens).
    ignore_merges: a word that is itself a token is not split further.
    add_bos: llama.cpp's default for `tokenizer.ggml.add_bos_token`.
    clean_spaces: `decode` removes the space before ?!., and in contractions.
    escape_whitespaces: spaces become U+2581 before BPE (SentencePiece-style BPE).
    bos_null: the vocabulary has no default BOS.
  """

  kind: str
  regexes: tuple[str, ...]
  byte_encode: bool = True
  ignore_merges: bool = False
  add_bos: bool = False
  clean_spaces: bool = True
  escape_whitespaces: bool = False
  bos_null: bool = False


_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...], bool], ...] = (
  # (llama.cpp pre types, their regexes in order, byte_encode)
  (("llama3", "dbrx", "smaug", "chatglm4"), (LLAMA3,), True),
  (
    ("jais2",),
    (
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    ),
    True,
  ),
  (
    ("deepseek_llm",),
    (
      "[\r\n]",
      "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
      "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
      "\\s+$",
      "[一-龥ࠀ-一가-\ud7ff]+",
      "\\p{N}+",
    ),
    True,
  ),
  (
    ("deepseek3_llm", "hunyuan_dense", "joyai_llm", "hy_v4"),
    (
      "\\p{N}{1,3}",
      "[一-龥\u3040-ゟ゠-ヿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("spark2_5",),
    (
      "\\p{N}{1,3}",
      "[一-龥\u3040-ゟ゠-ヿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
      "\\p{N}",
    ),
    True,
  ),
  (
    ("youtu",),
    (
      "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+",
      "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("deepseek_coder",),
    ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-\ud7ff]+", "\\p{N}"),
    True,
  ),
  (("falcon",), ("[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2, "[0-9][0-9][0-9]"), True),
  (
    ("starcoder", "refact", "command_r", "smollm", "codeshell", "exaone", "minerva", "mellum2"),
    ("\\p{N}", GPT2),
    True,
  ),
  (("gpt2", "mpt", "olmo", "jais", "trillion", "granite_docling"), (GPT2,), True),
  (("stablelm2", "qwen2", "hunyuan", "solar_open", "grok_2"), (QWEN2,), True),
  (("qwen35",), (QWEN35,), True),
  (("poro", "bloom", "gpt3_finnish"), (" ?[^(\\s|.,!?…。，、।۔،)]+",), True),
  (("viking",), (" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"), True),
  (
    ("tekken",),
    (
      "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("chameleon",),
    (
      "<sentinel:[0-9]+>",
      "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
      "([\\t\\n]|    |  )",
      "\\p{N}",
      "[\\p{P}!-/:-@\\[-`{-~]",
      GPT2,
    ),
    True,
  ),
  (
    ("gpt4o", "minimax_m2"),
    (
      "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("granite_emb_multi",),
    (
      "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("tiny_aya",),
    (
      TINY_AYA_DIGITS,
      "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (("kimi_k2",), (KIMI_K2,), True),
  (("superbpe",), ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"), True),
  (
    ("bailingmoe",),
    (
      "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("seed_coder",),
    (
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("ufakzeka",),
    (
      "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (
    ("afmoe",),
    (
      AFMOE_DIGITS,
      "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (("laguna",), (NEWLINES, QWEN2), True),
  (
    ("exaone_moe",),
    (
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (("gemma4", "sarvam_moe"), (NEWLINES,), False),
  (
    ("minicpm5",),
    (
      "\\p{N}{1,3}",
      "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    True,
  ),
  (("whitespace",), ("\\S+",), False),
  (("default",), ("[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]"), True),
)

_NAMES: tuple[tuple[str, tuple[str, ...], str], ...] = (
  # (llama.cpp pre type, tokenizer.ggml.pre names, flags that differ from BPE defaults)
  ("default", ("default",), ""),
  ("minicpm5", ("minicpm5",), "ignore_merges"),
  (
    "llama3",
    (
      "llama3",
      "llama-v3",
      "llama-bpe",
      "falcon3",
      "falcon-h1",
      "pixtral",
      "midm-2.0",
      "lfm2",
      "jina-v5-nano",
    ),
    "add_bos ignore_merges",
  ),
  ("deepseek_llm", ("deepseek-llm",), "no_clean_spaces"),
  ("deepseek_coder", ("deepseek-coder",), "no_clean_spaces"),
  ("deepseek3_llm", ("deepseek-v3",), "no_clean_spaces"),
  ("spark2_5", ("spark2_5",), "no_clean_spaces"),
  ("youtu", ("youtu",), "no_clean_spaces ignore_merges"),
  ("falcon", ("falcon",), ""),
  ("mpt", ("mpt",), ""),
  ("starcoder", ("starcoder",), ""),
  (
    "gpt2",
    (
      "gpt-2",
      "phi-2",
      "jina-es",
      "jina-de",
      "gigachat",
      "jina-v2-es",
      "jina-v2-de",
      "a.x-4.0",
      "mellum",
      "modern-bert",
    ),
    "",
  ),
  ("jais2", ("jais-2",), ""),
  ("gemma4", ("gemma4", "granite-embed-multi-311m"), "escape_whitespaces"),
  ("sarvam_moe", ("sarvam-moe",), "no_clean_spaces escape_whitespaces"),
  ("gpt2", ("jina-v1-en", "jina-v2-code", "roberta-bpe"), "add_sep"),
  ("whitespace", ("whitespace",), "no_lowercase"),
  ("refact", ("refact",), ""),
  ("command_r", ("command-r",), "no_clean_spaces"),
  ("qwen2", ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), "no_clean_spaces"),
  ("qwen35", ("qwen35",), "no_clean_spaces"),
  ("stablelm2", ("stablelm2",), ""),
  ("olmo", ("olmo",), ""),
  ("dbrx", ("dbrx",), ""),
  ("smaug", ("smaug-bpe",), ""),
  ("poro", ("poro-chat",), "no_clean_spaces"),
  ("chatglm4", ("chatglm-bpe",), "bos_null"),
  ("chatglm4", ("glm4", "glm5"), "bos_null ignore_merges"),
  ("viking", ("viking",), "no_clean_spaces"),
  ("jais", ("jais",), ""),
  ("tekken", ("tekken",), "add_bos no_clean_spaces ignore_merges"),
  ("smollm", ("smollm",), "no_clean_spaces"),
  ("codeshell", ("codeshell",), ""),
  ("bloom", ("bloom",), ""),
  ("gpt3_finnish", ("gpt3-finnish",), ""),
  ("exaone", ("exaone",), ""),
  ("gpt2", ("exaone4",), ""),
  ("exaone_moe", ("exaone-moe",), ""),
  ("chameleon", ("chameleon",), "add_bos no_clean_spaces"),
  ("minerva", ("minerva-7b",), ""),
  ("qwen2", ("megrez",), ""),
  ("gpt4o", ("gpt-4o", "llama4", "kanana2", "talkie"), "no_clean_spaces"),
  ("granite_emb_multi", ("granite-embed-multi-97m",), "no_clean_spaces ignore_merges"),
  ("tiny_aya", ("tiny_aya", "cohere2moe"), "no_clean_spaces"),
  ("superbpe", ("superbpe",), "no_clean_spaces"),
  ("trillion", ("trillion",), "no_clean_spaces"),
  ("granite_docling", ("granite-docling",), "no_clean_spaces"),
  ("bailingmoe", ("bailingmoe", "bailingmoe2", "llada-moe"), "no_clean_spaces"),
  ("seed_coder", ("seed-coder",), "no_clean_spaces"),
  ("hunyuan", ("hunyuan",), "no_clean_spaces"),
  ("hunyuan_dense", ("hunyuan-dense",), "no_clean_spaces"),
  ("hy_v4", ("hy_v4",), "no_clean_spaces"),
  ("joyai_llm", ("joyai-llm",), "no_clean_spaces"),
  ("kimi_k2", ("kimi-k2",), "no_clean_spaces"),
  ("ufakzeka", ("ufakzeka",), "no_clean_spaces"),
  ("grok_2", ("grok-2",), "no_clean_spaces"),
  ("afmoe", ("afmoe",), "no_clean_spaces"),
  ("laguna", ("laguna",), "no_clean_spaces"),
  ("minimax_m2", ("minimax-m2",), "no_clean_spaces"),
  ("solar_open", ("solar-open",), "no_clean_spaces"),
  ("mellum2", ("mellum2",), ""),
)


REGEXES: dict[str, tuple[tuple[str, ...], bool]] = {
  kind: (regexes, byte_encode) for kinds, regexes, byte_encode in _GROUPS for kind in kinds
}
"""llama.cpp pre type -> (regexes, byte_encode)."""

_FLAGS = {"ignore_merges", "add_bos", "no_clean_spaces", "escape_whitespaces", "bos_null"}
_IGNORED = {"add_sep", "no_lowercase"}  # embedding-model settings that tokenizing ignores


def _entry(kind: str, flags: str) -> PreTokenizer:
  words = set(flags.split())
  assert words <= _FLAGS | _IGNORED, words - _FLAGS - _IGNORED
  regexes, byte_encode = REGEXES[kind]
  return PreTokenizer(
    kind,
    regexes,
    byte_encode=byte_encode,
    ignore_merges="ignore_merges" in words,
    add_bos="add_bos" in words,
    clean_spaces="no_clean_spaces" not in words,
    escape_whitespaces="escape_whitespaces" in words,
    bos_null="bos_null" in words,
  )


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
  name: _entry(kind, flags) for kind, names, flags in _NAMES for name in names
}
"""`tokenizer.ggml.pre` -> its `PreTokenizer`, for every name llama.cpp knows."""

DEFAULT = PRE_TOKENIZERS["default"]
"""What llama.cpp uses for a BPE vocabulary without `tokenizer.ggml.pre`."""
