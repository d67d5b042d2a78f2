"""Structured output benchmarks: the grammar engines compared (grammar_engines.py), the schemas
clients send (schemas.py), and the engine's step time with grammar masks (bench.engine's
structured_output)."""
