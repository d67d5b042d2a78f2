"""Real processes to break and the faults done to them: the fault scenarios and the soak that
tests/fault/ asserts on and `python -m bench.faults` records (bench/results/faults/)."""
