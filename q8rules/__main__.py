"""`python -m q8rules`: the demo (see q8rules/demo.py); `python -m q8rules run MODEL.gguf ...`
runs a GGUF model (see q8rules/llm/cli.py)."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "run":
  from q8rules.llm.cli import main as run_main

  run_main(sys.argv[2:])
else:
  from q8rules.demo import main

  main()
