"""`python -m q8rules`: the command line (q8rules/cli): `demo` (the default), `run`, ..."""

from q8rules.cli import main

raise SystemExit(main())
