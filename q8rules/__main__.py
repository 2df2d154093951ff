"""`python -m q8rules`: the demo (see q8rules/demo.py)."""

from q8rules.demo import main

main()
