"""`python -m bench.dashboard`: see bench/dashboard/__init__.py."""

from bench.dashboard.run import main

main()
