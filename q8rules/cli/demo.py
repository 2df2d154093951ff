"""`q8rules demo` (the default command): the built-in decoder served float and as Q8_0: what
the rules matched, which path each op took, the weight bytes, the error against float, the
time of one decode step of each (q8rules/demo.py)."""

from __future__ import annotations

import argparse

from q8rules import demo_options

NAME = "demo"
HELP = "the rules on the built-in decoder: matches, paths, bytes, error, time"
EXAMPLE = "q8rules demo --layers 2 --dim 256"


def add_arguments(p: argparse.ArgumentParser) -> None:
  demo_options.add_arguments(p)


def execute(args: argparse.Namespace) -> dict:
  from q8rules import demo

  return demo.run(args)
