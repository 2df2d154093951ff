"""User errors as one line on stderr: `q8rules: error: <message>`, exit status 2 for bad
arguments and 1 for bad files or models; a traceback only with `--debug`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

PROG = "q8rules"


class UsageError(Exception):
  """A bad argument found after parsing (ids outside the vocabulary, a prompt past the
  context): exit status 2."""


class ModelError(Exception):
  """A file or model that cannot do what was asked (no tokenizer, no chat template): exit
  status 1."""


def fail(message: str, status: int) -> NoReturn:
  """Print `q8rules: error: message` (one line) on stderr and exit with `status`."""
  print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
  raise SystemExit(status)


class OneLineParser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line (no usage block) and exit 2."""

  def error(self, message: str) -> NoReturn:
    fail(f"{message} (see `{self.prog} --help`)", 2)


OS_FILE_ERRORS = (FileNotFoundError, IsADirectoryError, PermissionError)


def file_errors() -> tuple[type[Exception], ...]:
  """The errors of a file or model that cannot be used: `OS_FILE_ERRORS`, `ModelError` and
  `CheckpointError`, imported here, when an error is being handled: the checkpoint modules load
  JAX, which parsing the command line must not."""
  from q8rules.checkpoint import CheckpointError

  return (*OS_FILE_ERRORS, CheckpointError, ModelError)


def guarded(run: Callable[[], object], debug: bool) -> int:
  """`run()`, its user errors turned into one line and an exit status (the traceback too with
  `debug`); 0 when it returns."""
  try:
    run()
  except UsageError as e:
    if debug:
      raise
    fail(str(e), 2)
  except KeyboardInterrupt:
    print(file=sys.stderr)
    return 130
  except file_errors() as e:  # evaluated only once an error is raised
    if debug:
      raise
    what = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror}"
    fail(what, 1)
  except Exception as e:
    if debug:
      raise
    fail(f"{type(e).__name__}: {e} (rerun with --debug for the traceback)", 1)
  return 0


def positive_int(text: str) -> int:
  """argparse type: an int >= 1."""
  return _ranged(int, text, lambda v: v >= 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
  return _ranged(int, text, lambda v: v >= 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
  return _ranged(float, text, lambda v: v >= 0, "a number >= 0")


def positive_float(text: str) -> float:
  return _ranged(float, text, lambda v: v > 0, "a number > 0")


def finite_float(text: str) -> float:
  return _ranged(float, text, lambda v: abs(v) != float("inf"), "a finite number")


def unit_open_closed(text: str) -> float:
  """argparse type: a number in (0, 1]."""
  return _ranged(float, text, lambda v: 0 < v <= 1, "a number in (0, 1]")


def unit_closed(text: str) -> float:
  return _ranged(float, text, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def half_unit(text: str) -> float:
  """argparse type: a number in [0, 0.5]."""
  return _ranged(float, text, lambda v: 0 <= v <= 0.5, "a number in [0, 0.5]")


def _ranged(kind: type, text: str, ok: Callable[[float], bool], what: str):
  try:
    value = kind(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
  if value != value or not ok(value):  # NaN fails every range
    raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
  return value
