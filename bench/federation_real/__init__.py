"""The routing arms on a real federation, and the same scenario in fedsim (issues 71 and 78).

The real gateway (its routing profiles, load reports, offload) in front of one real site per GPU
(`python -m site_engine`, CUDA_VISIBLE_DEVICES per site; on the CPU, tiny models), sites unequal
by model shape (Llama-3.2-1B and Llama-3.1-8B, random weights, at the batch sizes operators run)
or by batch limits, an emulated one-way delay in front of each (bench/federation_real/wan.py), a
workload replayed open loop through the public API from client processes (ShareGPT-like lengths,
or a trace's arrivals and prefix blocks). The offered loads are multiples of the pair's capacity,
measured through the gateway before the arms (capacity.py); every seed at every load is a cell
(grid.py), run by every arm (arms.py). Each arm reports goodput at the SLO, TTFT and TPOT
p50/p99, prefix hits, the requests each site completed, its gateway's CPU; then fedsim replays
the very same requests over the same sites with the card's fitted step models (or the cost each
site learned) and the serving path's CPU (fedsim/serving_path.py), and the two are put side by
side with the simulator's error per arm and metric and whether the arms rank the same
(docs/simulator.md, "The federation-level check").
"""
