"""Calibration of the simulator: the step-time model fitted on GPU step profiles (fit.py), its
error on held-out steps, and the replay of measured GPU runs (replay.py). `python -m
fedsim.calibrate` writes bench/results/sim/calibration_<gpu>.{json,md}."""
