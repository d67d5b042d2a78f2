"""Capacity that follows load, measured: `python -m bench.elastic` (docs/elastic.md)."""
