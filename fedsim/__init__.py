"""fedsim: the federation on a virtual clock, for policy questions that need hundreds of runs over
tens of sites (docs/simulator.md).

What is real: each simulated site runs the engine core itself (site_engine.engine.core's
Scheduler: its block manager, prefix cache, priority classes, adapter slots), and the gateway
side is the gateway's own routing (gateway/routing profiles over gateway.sites.registry
SiteState, its leases, its offload planner). What is fitted: the model's forward, replaced by a
step time from GPU profiles (fedsim/step_time.py, fitted by fedsim/calibrate/). Imports no torch
(an import contract in pyproject.toml).
"""
