"""Structured output benchmarks: the schemas clients send (schemas.py), a new schema's compile
beside other streams (grammar_stall.py) and the engine's step time with grammar masks
(bench.engine's structured_output). The grammar engines' comparison is at git tag
`study/grammar-engines`."""
