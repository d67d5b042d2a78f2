"""The federation benchmark (issue 21): unequal site engines behind one gateway, a wide-area
latency injector between them, open-loop Poisson arrivals of long prompts through the public
HTTP API, every routing policy compared at a sweep of rates in one run, and offload under a
slowed and a killed site. `python -m bench.federation --help`; docs/federation-bench.md.
"""
