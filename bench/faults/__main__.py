"""`python -m bench.faults`: see bench/faults/__init__.py."""

from bench.faults.run import main

main()
