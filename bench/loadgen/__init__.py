"""Open-loop load through the gateway's public API and the workloads it sends (the long-prompt
mix, the Mooncake trace), with the random models the sites serve: what `python -m bench.elastic`
drives. What is left of the federation benchmark, whose policy comparisons the simulator
(`python -m fedsim.study`, docs/simulator.md) now makes.
"""
