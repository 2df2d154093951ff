"""`q8rules chat MODEL.gguf`: a conversation with a chat model, through the file's own chat
template (`q8rules.llm.chat`: rendered as llama-cpp-python renders it).

Each line read from stdin is a user turn; the reply streams to stdout and stops at the model's
end-of-turn or end-of-generation token. An empty line or end of input ends the chat. `-p`
gives the first turn (and `--once` ends after its reply); `--system` a system message. The
model line and each reply's rate go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from q8rules.cli.errors import UsageError
from q8rules.cli.run import add_sampling, context_of, load, sampler_of

NAME = "chat"
HELP = "talk to a chat model through its chat template"
EXAMPLE = 'q8rules chat SmolLM2-135M-Instruct.Q4_1.gguf -p "What is the capital of France?"'


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_sampling(p)
  p.set_defaults(max_new_tokens=256)
  p.add_argument("-p", "--prompt", default=None, help="the first user turn (None: read stdin)")
  p.add_argument("--system", default=None, help="a system message first (None: none)")
  p.add_argument("--once", action="store_true", help="end after the first reply")


def turns(first: str | None, once: bool):
  """The user's turns: `first`, then stdin's lines (a '> ' prompt on stderr when it is a
  terminal) until an empty line or the end of input."""
  if first is not None:
    yield first
    if once:
      return
  while True:
    if sys.stdin.isatty():
      print("> ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
      return
    yield line.rstrip("\n")


def execute(args: argparse.Namespace) -> dict:
  """Run the chat; returns the messages."""
  from q8rules.llm.chat import ChatSession

  m, _ = load(args)
  context = context_of(m, args)
  session = ChatSession(
    m, system=args.system, max_new_tokens=args.max_new_tokens, sampler=sampler_of(args)
  )
  for text in turns(args.prompt, args.once):
    start = time.perf_counter()
    user = [*session.messages, {"role": "user", "content": text}]
    room = context - len(m.apply_chat_template(user, add_generation_prompt=True))
    if room < 1:
      raise UsageError(f"the conversation has filled the context of {context} tokens (-c/--ctx)")
    session.max_new_tokens = min(args.max_new_tokens, room)
    for piece in session.send(text):
      sys.stdout.write(piece)
      sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    reply_ids = m.tokenizer.encode(session.messages[-1]["content"], add_special=False)
    seconds = time.perf_counter() - start
    rate = len(reply_ids) / seconds if seconds > 0 else float("inf")
    print(
      f"[{len(reply_ids)} generated tokens in {seconds:.2f} s, prompt included:"
      f" {rate:.1f} generated tokens/s]",
      file=sys.stderr,
    )
  return dict(messages=session.messages)
