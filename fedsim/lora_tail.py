"""The LoRA mix at fixed rates, run to the end (no give-up): how many requests complete and
their time to first token, p50 / p99 / max. The routing study's goodput (fedsim/study.py) gives
up a run once 1% of its requests are past the TTFT bound, so it cannot tell a request waiting
a few seconds for an adapter slot from one that waits for ever (docs/simulator.md).

    python -m fedsim.lora_tail --rates 20 --duration-s 60 --seeds 0 1 2 [--overtake-steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fedsim.federation import run
from fedsim.gateway import GatewaySettings
from fedsim.study import RESULTS, cases
from fedsim.workload import WorkloadSpec, build


def tail(
    rate: float, duration_s: float, seed: int, overtake_steps: int | None, models: Path
) -> str:
    case = next(c for c in cases(quick=True) if c.adapters)
    sites = [
        dataclasses.replace(site, adapter_overtake_steps=overtake_steps)
        for site in case.sites(models)
    ]
    spec = WorkloadSpec(
        case.source,
        rate,
        duration_s,
        seed,
        "served",
        8192,
        case.adapters,
        case.adapter_share,
        None,
    )
    result = run(sites, build(spec), GatewaySettings(policy="completion_cost"), drain_s=120.0)
    ttft = sorted(result.ttft_s)

    def at(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))]

    return (
        f"{case.name} {rate:g} req/s seed {seed}: {result.completed}/{result.requests} "
        f"completed; TTFT p50 {at(0.5):.2f} p99 {at(0.99):.2f} max {ttft[-1]:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[20.0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--overtake-steps", type=int, default=None)
    parser.add_argument("--step-models", type=Path, default=RESULTS / "step_models_pregrid.json")
    args = parser.parse_args()
    for seed in args.seeds:
        for rate in args.rates:
            line = tail(rate, args.duration_s, seed, args.overtake_steps, args.step_models)
            print(line, flush=True)


if __name__ == "__main__":
    main()
