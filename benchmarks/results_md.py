"""benchmarks/RESULTS.md: one file, one section per benchmark between its own markers."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def markers(name: str) -> tuple[str, str]:
  """The start and end markers of section `name`, e.g. `<!-- cpu:start -->`."""
  return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(name: str, text: str, path: Path = RESULTS) -> None:
  """Replace section `name` of `path` by `text` (which carries the markers), or append it;
  every other section stays as it is."""
  start, end = markers(name)
  old = path.read_text() if path.exists() else "# Benchmark results\n"
  if start in old and end in old:
    head, rest = old.split(start, 1)
    _, tail = rest.split(end, 1)
    new = head + text + tail
  else:
    new = old.rstrip("\n") + "\n\n" + text + "\n"
  path.write_text(new)
