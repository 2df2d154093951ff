"""Server-sent events of a streamed OpenAI completion, as the benchmarks read them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
  """Each `data:` event's JSON object, up to `[DONE]` (other lines skipped)."""
  for line in lines:
    if not line.startswith("data: ") or line == "data: [DONE]":
      continue
    yield json.loads(line[6:])
