"""The response bodies, as OpenAI returns them: `id`, `object`, `created`, `model`, `choices`
(with `finish_reason` and, when asked for, `logprobs`) and `usage`; plain dicts."""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
  return {
    "prompt_tokens": prompt,
    "completion_tokens": completion,
    "total_tokens": prompt + completion,
  }


def base(kind: str, rid: str, model: str) -> dict[str, Any]:
  return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
  """Chat's `logprobs`: {'content': [{'token', 'logprob', 'bytes', 'top_logprobs'}]}."""
  return {"content": entries}


def completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
  """Text completions' legacy `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
  offsets, at = [], offset
  for e in entries:
    offsets.append(at)
    at += len(e["token"])
  return {
    "tokens": [e["token"] for e in entries],
    "token_logprobs": [e["logprob"] for e in entries],
    "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
    "text_offset": offsets,
  }


__all__ = ["base", "chat_logprobs", "completion_logprobs", "new_id", "usage"]
