"""Training data for `q8rules finetune`: a plain text as one token stream, or chat conversations
rendered through the model file's own chat template with only the replies as targets.

Both give batches of (tokens (B, T) int32, mask (B, T) bool) for `LoraTrainer.step`, where mask
marks the tokens the loss counts (`q8rules.lora.trainer.next_token_loss`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from q8rules.lora.loaded import LoadedModel

Batch = tuple[np.ndarray, np.ndarray]
Sampler = Callable[[], Batch]


def text_windows(
  ids: Any, length: int, batch: int, *, seed: int = 0, exclude: Sequence[tuple[int, int]] = ()
) -> Sampler:
  """Windows of `length` tokens of the stream `ids` (1-D), `batch` of them at random offsets per
  draw, none overlapping a [start, stop) span of `exclude` (the held-out tokens,
  `q8rules.lora.heldout.held_out_spans`); every token a target.

  Raises:
    ValueError: an empty text, or no window of `length` tokens clear of `exclude`.
  """
  from q8rules.lora.heldout import train_starts

  ids = np.asarray(ids, np.int32)
  if ids.ndim != 1 or ids.size == 0:
    raise ValueError("the text is empty: no token to train on")
  starts = train_starts(ids.size, length, exclude)
  if starts.size == 0:
    raise ValueError(f"the text has {ids.size} tokens, fewer than one window of {length}")
  rng = np.random.default_rng(seed)

  def draw() -> Batch:
    tokens = np.stack([ids[s : s + length] for s in rng.choice(starts, size=batch)])
    return tokens, np.ones_like(tokens, bool)

  return draw


def conversation_ids(
  m: LoadedModel, messages: Sequence[Mapping[str, Any]]
) -> tuple[list[int], list[bool]]:
  """One conversation through `m`'s chat template: (ids, mask) with mask set on the tokens of
  each assistant reply (what the template adds from the prompt of that reply, rendered with
  `add_generation_prompt=True`, to the conversation up to and with it).

  Raises:
    ChatTemplateError naming the file: no template; ValueError: a template whose rendering of a
    longer conversation does not extend the shorter one's (the reply's tokens cannot be found).
  """
  ids = m.apply_chat_template(messages, add_generation_prompt=False)
  mask = [False] * len(ids)
  for i, message in enumerate(messages):
    if message.get("role") != "assistant":
      continue
    prompt = m.apply_chat_template(messages[:i], add_generation_prompt=True)
    upto = m.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
    if upto[: len(prompt)] != prompt or ids[: len(upto)] != upto:
      raise ValueError(
        f"{m.path}: the chat template's rendering of message {i} does not extend the"
        " conversation before it; its reply tokens cannot be told apart"
      )
    for j in range(len(prompt), len(upto)):
      mask[j] = True
  return ids, mask


def read_conversations(path: str | Path) -> list[list[dict[str, Any]]]:
  """A JSON-lines file of conversations: each line {"messages": [{"role", "content"}, ...]} (or
  the list itself).

  Raises:
    ValueError naming the file and line: not JSON, no messages, a message without role/content.
  """
  out = []
  for n, line in enumerate(Path(path).read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      item = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{n}: not JSON: {e}") from e
    messages = item.get("messages") if isinstance(item, dict) else item
    if not isinstance(messages, list) or not messages:
      raise ValueError(f"{path}:{n}: no 'messages' list")
    for msg in messages:
      if not isinstance(msg, dict) or not {"role", "content"} <= set(msg):
        raise ValueError(f"{path}:{n}: a message without 'role' and 'content': {msg!r}")
    if not any(msg["role"] == "assistant" for msg in messages):
      raise ValueError(f"{path}:{n}: no assistant message to learn from")
    out.append(messages)
  if not out:
    raise ValueError(f"{path}: no conversation in the file")
  return out


def chat_batches(
  m: LoadedModel,
  conversations: Sequence[Sequence[Mapping[str, Any]]],
  length: int,
  batch: int,
  *,
  seed: int = 0,
) -> Sampler:
  """`batch` conversations per draw, at random, each rendered by `conversation_ids`, cut to
  `length` tokens or padded to it (padding: token 0, not a target)."""
  rendered = [conversation_ids(m, c) for c in conversations]
  rng = np.random.default_rng(seed)

  def draw() -> Batch:
    tokens = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), bool)
    for row, k in enumerate(rng.integers(0, len(rendered), size=batch)):
      ids, targets = rendered[k]
      n = min(length, len(ids))
      tokens[row, :n], mask[row, :n] = ids[:n], targets[:n]
    return tokens, mask

  return draw


__all__ = ["chat_batches", "conversation_ids", "read_conversations", "text_windows"]
