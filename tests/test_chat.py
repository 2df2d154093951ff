"""Chat templates (q8rules/llm/chat.py) against llama-cpp-python's renderings and ids
(tests/data/chat_refs.json, scripts/make_chat_references.py): 6 templates (the real
SmolLM2-135M-Instruct file's, Llama 3's, Gemma's, Mistral's, Phi-3's, a ChatML with tojson) x 5
conversations x add_generation_prompt; the errors; a ChatSession and `q8rules chat`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from gguf import GGUFValueType as V

from q8rules.llm.chat import ChatSession, ChatTemplateError, render, template_of

REFS = json.loads((Path(__file__).parent / "data" / "chat_refs.json").read_text())
CASES = REFS["cases"]
DATA = Path(__file__).parent / "data" / "gguf_models"


def case_id(c: dict) -> str:
  return f"{c['template']}-{c['messages']}-{'gen' if c['add_generation_prompt'] else 'nogen'}"


def smollm2() -> Path:
  from scripts.fetch_real_models import SMOLLM2_Q4_1, cache_dir

  path = cache_dir() / SMOLLM2_Q4_1.file
  if not path.exists():
    if os.environ.get("Q8RULES_REQUIRE_MODELS") == "1":
      pytest.fail(f"{path} missing")
    pytest.skip(f"{path} missing: run scripts/fetch_real_models.py")
  return path


def ours(c: dict) -> str:
  return render(
    REFS["templates"][c["template"]],
    REFS["conversations"][c["messages"]],
    bos_token=REFS["bos_token"],
    eos_token=REFS["eos_token"],
    add_generation_prompt=c["add_generation_prompt"],
    path="t",
  )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rendered_text_is_llama_cpp_pythons(case):
  if "error" in case:
    with pytest.raises(ChatTemplateError, match=r"t: the chat template fails to render"):
      ours(case)
    return
  assert ours(case) == case["text"]


@pytest.mark.slow
def test_ids_are_llama_cpp_pythons():
  """Every rendered case tokenized with the SmolLM2 file's vocabulary (special tokens parsed,
  nothing added): the ids llama-cpp-python gives."""
  from q8rules.checkpoint.gguf import open_gguf
  from q8rules.llm.chat import apply_chat_template
  from q8rules.llm.tokenizer import GGUFTokenizer

  path = smollm2()
  with open_gguf(path) as ckpt:
    meta = ckpt.metadata
  tok = GGUFTokenizer.from_metadata(meta, path=str(path))
  checked = 0
  for c in CASES:
    if "error" in c:
      continue
    ids = apply_chat_template(
      tok,
      meta,
      REFS["conversations"][c["messages"]],
      add_generation_prompt=c["add_generation_prompt"],
      template=REFS["templates"][c["template"]],
    )
    assert ids == c["ids"], case_id(c)
    checked += 1
  assert checked == 56


def test_errors_name_the_file():
  with pytest.raises(ChatTemplateError, match=r"f\.gguf: no chat template"):
    template_of({}, "f.gguf")
  with pytest.raises(ChatTemplateError, match=r"f\.gguf: the chat template fails to render"):
    render("{% for %}", [], path="f.gguf")
  with pytest.raises(ValueError, match=r"message 1 \(user\) has no 'content'"):
    render("x", [{"role": "user", "content": "a"}, {"role": "user"}])
  with pytest.raises(ValueError, match=r"message 0 has no 'role'"):
    render("x", [{"content": "a"}])


def chat_model(tmp_path: Path):
  """The tiny qwen2 with a ChatML template (its markers are not special tokens of the tiny
  vocabulary: the template only writes text)."""
  import q8rules
  from tests.test_llm_gguf_errors import rewrite_to

  template = REFS["templates"]["chatml_tojson"]
  path = rewrite_to(
    tmp_path,
    "chat.gguf",
    src=DATA / "tiny-qwen2-q8_0.gguf",
    typed_meta={"tokenizer.chat_template": (template, V.STRING, None)},
  )
  return q8rules.load_gguf(path, dtype=jnp.float32, progress=False)


def test_chat_session_renders_the_whole_conversation(tmp_path):
  m = chat_model(tmp_path)
  session = ChatSession(m, system="Be brief.", max_new_tokens=5)
  reply = "".join(session.send("Hello"))
  assert [x["role"] for x in session.messages] == ["system", "user", "assistant"]
  assert session.messages[-1]["content"] == reply
  ids = m.apply_chat_template(session.messages[:2])
  eog = m.tokenizer.eog_ids
  want = [t for t in m.generate(ids, 5, stop_ids=sorted(eog)) if t not in eog]
  assert reply == m.tokenizer.decode(want)
  session.send("More")  # a generator: nothing runs until read
  list(session.send("Again"))
  assert session.prompt_ids()[: len(ids)] == ids  # earlier turns are the prompt's start


def test_a_model_without_template_is_refused(tmp_path):
  import q8rules

  m = q8rules.load_gguf(DATA / "tiny-qwen2-q8_0.gguf", progress=False)
  with pytest.raises(ChatTemplateError, match="tiny-qwen2-q8_0.gguf: no chat template"):
    ChatSession(m)
  with pytest.raises(ChatTemplateError, match="no chat template"):
    m.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_chat_command_on_a_real_model():
  """`q8rules chat` on SmolLM2-135M-Instruct: two turns from stdin, each reply stopping at the
  model's end of turn, the second knowing the first."""
  proc = subprocess.run(
    [sys.executable, "-m", "q8rules", "chat", str(smollm2()), "-n", "40", "--no-progress"],
    input="What is the capital of France?\nAnd of Germany?\n",
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr
  first, second = proc.stdout.splitlines()[:2]
  assert "Paris" in first and "Berlin" in second, proc.stdout
  assert proc.stderr.count("tokens in") == 2
