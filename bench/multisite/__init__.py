"""The multi-site benchmark: MICO's Table 1 and more, on real site engine processes (random tiny
models on CPU, loaded through the real path) behind the real gateway, over real HTTP.

    python -m bench.multisite            (~20 min on 2 cores; bench/results/multisite/)
    python -m bench.multisite --quick    (a tiny grid: the smoke test's run)

Phases: Table 1 (round robin / token-balanced routing x static / iteration-level engines at
2-9 sites and max batch 2-10, with a predictor ablation in one cell), scenarios MICO did not
measure (skewed arrivals, unequal capacity, a slowed site with and without offload, a site
killed mid-run), bad-input checks, and the routing decision time at 9 sites.
"""
