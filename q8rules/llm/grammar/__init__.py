"""Constrained decoding: a grammar per request, a token mask per step (llguidance).

A request that asks for structured output (OpenAI's `response_format` with `json_object` or
`json_schema`, llama-server's `json_schema` and GBNF `grammar`) gets a `Grammar` (`forms`):
the grammar compiled and checked once against the model's vocabulary, or a `GrammarError`
naming the field. Each generated row then holds a `RowMatcher` (`matcher`): before a step it
writes its allowed tokens as a packed bitmask row (int32 words, bit `j % 32` of word `j // 32`
for token j), after the step it consumes the sampled token. `apply_bitmask` (`q8rules.engine.bitmask`) applies a
(rows, words) bitmask to (rows, vocab) logits on the device, inside the batched sampling step,
so constrained and free rows (an all-ones row) sample together.

The vocabulary goes to llguidance once per tokenizer (`vocab.ll_tokenizer`): each id's bytes
as llama.cpp's `token_to_piece` gives them, control tokens marked special (a 0xFF prefix, as
llguidance's own llama.cpp bridge does), the file's EOS as the end token.
"""

from q8rules.engine.bitmask import apply_bitmask, free_bitmask, words_for
from q8rules.llm.grammar.forms import Grammar, GrammarError, grammar_for_request
from q8rules.llm.grammar.matcher import RowMatcher
from q8rules.llm.grammar.vocab import ll_tokenizer

__all__ = [
  "Grammar",
  "GrammarError",
  "RowMatcher",
  "apply_bitmask",
  "free_bitmask",
  "grammar_for_request",
  "ll_tokenizer",
  "words_for",
]
