"""`python -m bench.faults [--minutes N] [--soak-only]`: the fault scenarios of issue 9 and a
soak with random faults, on real processes (sites, gateway, PostgreSQL) on this machine; writes
bench/results/faults/faults.{json,md}. The tests in tests/fault/ assert on the same figures."""
