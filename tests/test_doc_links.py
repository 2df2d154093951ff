"""The markdown pages' links and headings: every relative link's file exists and its #anchor is
a heading there (GitHub's slugs); a page has one top-level heading and no heading more than one
level below the one before it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
  """`text` without its fenced code blocks (a `#` there is a comment, not a heading)."""
  return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def headings(text: str) -> list[tuple[int, str]]:
  return [(len(h), t.strip()) for h, t in re.findall(r"^(#{1,6}) (.+)$", prose(text), re.M)]


def slug(title: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as '-'."""
  title = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", title).lower()
  return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path):
  text = prose(page.read_text())
  dead = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target):
      continue  # http(s), mailto
    path, _, anchor = target.partition("#")
    where = (page.parent / path).resolve() if path else page
    if not where.exists():
      dead.append(f"{target}: no file {where}")
    elif anchor and where.suffix == ".md":
      if anchor not in {slug(t) for _, t in headings(where.read_text())}:
        dead.append(f"{target}: no heading #{anchor} in {where.name}")
  assert not dead, dead


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_headings_nest(page: Path):
  levels = [level for level, _ in headings(page.read_text())]
  assert levels and levels[0] == 1 and levels.count(1) == 1, levels
  jumps = [(a, b) for a, b in zip(levels, levels[1:], strict=False) if b > a + 1]
  assert not jumps, jumps
