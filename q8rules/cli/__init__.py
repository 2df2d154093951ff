"""The `q8rules` command line (`python -m q8rules`, or the `q8rules` console script): one entry
point, one module per subcommand.

A subcommand is a module with `NAME`, `HELP`, `EXAMPLE`, `add_arguments(parser)` and
`execute(args)`, listed in `COMMANDS`. With no subcommand (or only options) the demo runs, as
`python -m q8rules` always did. Errors are one line on stderr (`q8rules.cli.errors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from q8rules.cli import chat, demo, finetune, run, serve
from q8rules.cli.errors import PROG, OneLineParser, guarded

COMMANDS: list[ModuleType] = [demo, run, chat, finetune, serve]
"""The subcommands, in the order `--help` lists them."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """Each option's default after its help (a required option's default is SUPPRESS: it has
  none to show); descriptions and epilogs kept as written."""


def version() -> str:
  """`q8rules X.Y.Z` of the installed package (the source tree's `pyproject.toml` otherwise)."""
  from importlib import metadata

  try:
    return f"{PROG} {metadata.version('q8rules')}"
  except metadata.PackageNotFoundError:
    return f"{PROG} (not installed)"


def parser() -> OneLineParser:
  """The command line's parser: a subparser per command of `COMMANDS`."""
  epilog = "commands, with an example each:\n" + "\n".join(
    f"  {c.NAME:<8} {c.HELP}\n           {c.EXAMPLE}" for c in COMMANDS
  )
  top = OneLineParser(
    prog=PROG,
    description="Q8_0 quantization rules for JAX, and GGUF models run with them.",
    epilog=epilog + f"\n\n`{PROG} COMMAND --help` for a command's options; no command: the demo.",
    formatter_class=HelpFormatter,
  )
  top.add_argument("--version", action="version", version=version(), help="print the version")
  sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
  for c in COMMANDS:
    p = sub.add_parser(
      c.NAME,
      help=c.HELP,
      description=(c.__doc__ or c.HELP).strip(),
      formatter_class=HelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    c.add_arguments(p)
  return top


def main(argv: Sequence[str] | None = None) -> int:
  """Run the command line on `argv` (default: sys.argv[1:]); the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
    argv = [demo.NAME, *argv]  # the default command
  args = parser().parse_args(argv)
  if getattr(args, "threads", None):
    from q8rules.cli.threads import limit_threads

    status = guarded(lambda: limit_threads(args.threads), args.debug)
    if status:
      return status
  command = next(c for c in COMMANDS if c.NAME == args.command)
  return guarded(lambda: command.execute(args), args.debug)


__all__ = ["COMMANDS", "HelpFormatter", "main", "parser", "version"]
