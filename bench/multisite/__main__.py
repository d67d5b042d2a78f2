"""`python -m bench.multisite [--quick]`: see bench/multisite/__init__.py."""

from bench.multisite.suite import main

main()
