"""Write llama-cpp-python's renderings and token ids of chat templates for tests/test_chat.py:
tests/data/chat_refs.json.

Run with a Python that has llama-cpp-python (0.3.36; it need not be the test environment):

    /work/venv-llamacpp/bin/python scripts/make_chat_references.py

For each template (the real SmolLM2-135M-Instruct file's own, and the well-known templates of
`TEMPLATES` below, as their models' tokenizer_config.json ship them) and each message list of
`CONVERSATIONS`, with add_generation_prompt True and False: the text llama-cpp-python's
`Jinja2ChatFormatter` renders (the BOS and EOS texts of the SmolLM2 file's vocabulary) and its
ids as `Llama.create_chat_completion` tokenizes it (`tokenize(text, add_bos=False,
special=True)`) with that vocabulary (`Llama(path, vocab_only=True)`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path(os.environ.get("Q8RULES_MODEL_DIR", Path.home() / ".cache/q8rules/models"))
MODEL = MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"

TEMPLATES = {
  "llama3": (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content ="
    " '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] |"
    " trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
  ),
  "gemma": (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role"
    " not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] =="
    " 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must"
    " alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] =="
    " 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim +"
    " '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}"
  ),
  "mistral": (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') !="
    " (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate"
    " user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant'"
    " %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and"
    " assistant roles are supported!') }}{% endif %}{% endfor %}"
  ),
  "phi3": (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user'"
    " %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] =="
    " 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}"
    "{{ eos_token }}{% endif %}"
  ),
  "chatml_tojson": (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' +"
    " message['content'] | tojson + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
  ),
}

CONVERSATIONS = {
  "user": [{"role": "user", "content": "What is the capital of France?"}],
  "system_user": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes."},
  ],
  "multi_turn": [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "  Tell me a joke.  "},
  ],
  "unicode": [{"role": "user", "content": 'Ça va? 日本語で答えて 🙂 — "quotes" and \\ slashes'}],
  "empty": [{"role": "user", "content": ""}],
}


def main() -> None:
  llm = Llama(str(MODEL), vocab_only=True, verbose=False)
  bos = llm._model.token_get_text(llm.token_bos())
  eos = llm._model.token_get_text(llm.token_eos())
  templates = {"smollm2": llm.metadata["tokenizer.chat_template"], **TEMPLATES}
  refs = {"bos_token": bos, "eos_token": eos, "templates": templates, "cases": []}
  for tname, template in templates.items():
    for cname, messages in CONVERSATIONS.items():
      for gen in (True, False):
        fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                  add_generation_prompt=gen)  # fmt: skip
        case = {"template": tname, "messages": cname, "add_generation_prompt": gen}
        try:
          text = fmt(messages=messages).prompt
        except Exception as e:  # the template's raise_exception
          case["error"] = str(e)
        else:
          case["text"] = text
          case["ids"] = llm.tokenize(text.encode(), add_bos=False, special=True)
        refs["cases"].append(case)
  refs["conversations"] = CONVERSATIONS
  out = ROOT / "tests" / "data" / "chat_refs.json"
  out.write_text(json.dumps(refs, indent=1, ensure_ascii=False) + "\n")
  errors = sum("error" in c for c in refs["cases"])
  print(f"wrote {out}: {len(refs['cases'])} cases ({errors} raise)", file=sys.stderr)


if __name__ == "__main__":
  main()
