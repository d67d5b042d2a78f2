"""One case of the routing study at fixed rates, without the bisection: whether each arm meets
the SLO at each rate (where a bisection per arm and seed costs too much, e.g. 16 sites: a 30 s
point there is 1-2 CPU-minutes). One JSON line per run.

    python -m fedsim.study_points 16_unequal_sharegpt --rates 560 610 660 --seed 0 \
        --arms completion_cost least_requests round_robin
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from fedsim.federation import Slo, run
from fedsim.gateway import GatewaySettings
from fedsim.study import cases
from fedsim.workload import WorkloadSpec, build


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.study_points")
    parser.add_argument("case")
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    parser.add_argument("--arms", nargs="+", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    case = next(c for c in cases(quick=False) if c.name == args.case)
    sites, slo = case.sites(), Slo()
    for rate in args.rates:
        spec = WorkloadSpec(case.source, rate, args.duration_s, args.seed, "served", 8192,
                            case.adapters, case.adapter_share, None)  # fmt: skip
        requests = build(spec)
        for arm in args.arms:
            began = time.perf_counter()
            result = run(sites, requests, GatewaySettings(policy=arm), drain_s=120.0, give_up=slo)
            row = {"case": case.name, "arm": arm, "rate": rate, "seed": args.seed,
                   "duration_s": args.duration_s, "wall_s": time.perf_counter() - began,
                   "meets_slo": result.meets(slo)}  # fmt: skip
            print(json.dumps(row | result.summary()), flush=True)


if __name__ == "__main__":
    main()
