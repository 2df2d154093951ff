"""The demo's command-line options (`q8rules demo`, `q8rules.demo.main`): the built-in decoder's
shape, the decode steps compared and timed, the Q8_0 implementation.

Kept apart from `q8rules.demo`, which loads JAX, so that the command line builds its parsers
(and answers `--help` or a bad argument) without importing JAX.
"""

from __future__ import annotations

import argparse

IMPLEMENTATIONS = ("fold", "cpu", "xla", "xla_dequant", "reference")
"""`--implementation`'s choices: the Q8_0 product's implementations
(`q8rules.kernels.IMPLEMENTATIONS`, which tests/test_demo.py checks them against)."""


def count(text: str) -> int:
  """argparse type: an integer >= 1 (a model has at least one layer, one head, ...)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
  return value


def width(text: str) -> int:
  """argparse type: a positive multiple of 64 (the demo's heads are 64 wide)."""
  value = count(text)
  if value % 64:
    raise argparse.ArgumentTypeError(f"{text!r} is not a multiple of 64")
  return value


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The demo's options (the model's shape, the decode steps, the implementation)."""
  p.add_argument("--layers", type=count, default=4, help="decoder layers")
  p.add_argument("--dim", type=width, default=512, help="model width D (heads = D / 64)")
  p.add_argument(
    "--kv-heads", type=count, default=None, help="key/value heads (None: half the heads)"
  )
  p.add_argument("--ffn", type=count, default=1408, help="MLP hidden width F")
  p.add_argument("--vocab", type=count, default=2048, help="vocabulary size V (lm_head D x V)")
  p.add_argument("--steps", type=count, default=16, help="greedy decode steps compared")
  p.add_argument("--repeats", type=count, default=30, help="timed decode steps")
  p.add_argument(
    "--implementation",
    choices=IMPLEMENTATIONS,
    default=None,
    help="force one Q8_0 implementation (None: the best for the backend and shape)",
  )
  p.add_argument("--tied", action="store_true", help="tied embeddings (the table is the head)")
  p.add_argument("--bf16", action="store_true", help="bfloat16 activations")
