"""Constrained decoding (q8rules.llm.grammar): request forms -> grammars, the token bitmask on
the device against llguidance's own numpy application, and replies that parse and validate.

The replies are drawn from random logits through the mask (no model: the grammar alone decides
what may come out), on a test file's vocabulary and on the real SmolLM2 vocabulary (skipped
without the file unless `Q8RULES_REQUIRE_MODELS=1`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from q8rules.llm.grammar import (
  GrammarError,
  RowMatcher,
  apply_bitmask,
  free_bitmask,
  grammar_for_request,
  words_for,
)
from q8rules.llm.tokenizer import GGUFTokenizer

llguidance_numpy = pytest.importorskip("llguidance.numpy")

DATA = Path(__file__).parent / "data" / "gguf_models"

SCHEMAS = {
  "object": {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
  },
  "array-enum-number": {
    "type": "object",
    "properties": {
      "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
      "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["tags", "score"],
    "additionalProperties": False,
  },
  "nested": {
    "type": "object",
    "properties": {
      "inner": {
        "type": "object",
        "properties": {
          "ok": {"type": "boolean"},
          "n": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
      },
      "note": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["inner"],
    "additionalProperties": False,
  },
  "array-of-objects": {
    "type": "array",
    "items": {
      "type": "object",
      "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
      "required": ["id"],
      "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
  },
}


def tokenizer_of(name: str) -> GGUFTokenizer:
  if name == "tiny-qwen2":
    return GGUFTokenizer.from_gguf(DATA / "tiny-qwen2-q8_0.gguf")
  from scripts.fetch_real_models import SMOLLM2_Q4_1, cache_dir

  path = cache_dir() / SMOLLM2_Q4_1.file
  if not path.exists():
    if os.environ.get("Q8RULES_REQUIRE_MODELS") == "1":
      pytest.fail(f"{path} missing")
    pytest.skip(f"{path} missing: run scripts/fetch_real_models.py")
  return GGUFTokenizer.from_gguf(path)


@pytest.fixture(scope="module", params=["tiny-qwen2", "smollm2"])
def tokenizer(request) -> GGUFTokenizer:
  return tokenizer_of(request.param)


def draw(
  tokenizer: GGUFTokenizer,
  grammar,
  rng: np.random.Generator,
  limit: int = 300,
  lean: float = 0.0,
  special: bool = False,
) -> str:
  """A reply drawn from random logits through the grammar's mask (greedy on fresh noise).
  `lean` is added to the logits of the one-token texts that close a string or an object, so
  that a grammar without bounds (any object) ends in a few dozen tokens; `special`: the text
  writes control tokens out."""
  closing = np.zeros(tokenizer.vocab_size, np.float32)
  for text in ('"', "}", '"}', '",'):
    ids = tokenizer.encode(text, add_special=False)
    if len(ids) == 1:
      closing[ids[0]] = lean
  matcher = RowMatcher(grammar, tokenizer)
  bitmask = free_bitmask(1, tokenizer.vocab_size)
  ids: list[int] = []
  for _ in range(limit):
    matcher.fill(bitmask, 0)
    logits = jnp.asarray(rng.normal(size=(1, tokenizer.vocab_size)).astype(np.float32) + closing)
    token = int(jnp.argmax(apply_bitmask(logits, jnp.asarray(bitmask))[0]))
    if token == tokenizer.eos_id:
      assert matcher.finished or matcher.advance(token)
      return tokenizer.decode(ids, special=special)
    assert matcher.advance(token), matcher.error
    ids.append(token)
  raise AssertionError(f"no EOS in {limit} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_replies_parse_and_validate_against_their_schema(tokenizer, name):
  schema = SCHEMAS[name]
  form = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
  grammar = grammar_for_request(tokenizer, response_format=form)
  rng = np.random.default_rng(sum(map(ord, name)))
  for _ in range(6):
    reply = draw(tokenizer, grammar, rng)
    jsonschema.validate(json.loads(reply), schema)


def test_json_object_and_llama_server_forms(tokenizer):
  rng = np.random.default_rng(1)
  anything = grammar_for_request(tokenizer, response_format={"type": "json_object"})
  for _ in range(3):
    assert isinstance(json.loads(draw(tokenizer, anything, rng, lean=3.0)), dict)
  schema = SCHEMAS["object"]
  as_text = grammar_for_request(tokenizer, json_schema=json.dumps(schema))
  jsonschema.validate(json.loads(draw(tokenizer, as_text, rng)), schema)
  yes_no = grammar_for_request(tokenizer, grammar='root ::= "yes" | "no" | "maybe " [0-9]')
  replies = {draw(tokenizer, yes_no, rng) for _ in range(8)}
  assert replies <= {"yes", "no"} | {f"maybe {d}" for d in range(10)}, replies
  assert grammar_for_request(tokenizer, response_format={"type": "text"}) is None
  assert grammar_for_request(tokenizer) is None


def test_the_mask_on_the_device_is_llguidances():
  rng = np.random.default_rng(2)
  for rows, vocab in ((1, 33), (3, 320), (4, 49152 + 7)):
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, words_for(vocab)), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)
    bitmask[0, :] = -1  # a free row beside constrained ones
    want = logits.copy()
    llguidance_numpy.apply_token_bitmask_inplace(want, bitmask)
    got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0], logits[0])


@pytest.mark.parametrize(
  "fields, field",
  [
    (
      {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
      "response_format.json_schema.schema",
    ),
    (
      {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
      "response_format.json_schema",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"json_schema": '{"type": '}, "json_schema"),
    ({"json_schema": [1, 2]}, "json_schema"),
    ({"grammar": 'root ::= "a'}, "grammar"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"grammar": ""}, "grammar"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
  ],
)
def test_a_bad_constraint_is_an_error_naming_its_field(fields, field):
  tokenizer = tokenizer_of("tiny-qwen2")
  with pytest.raises(GrammarError) as e:
    grammar_for_request(tokenizer, **fields)
  assert e.value.field == field
  assert str(e.value).startswith(field + ": ")
