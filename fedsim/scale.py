"""What a simulation costs: wall seconds against sites and simulated traffic.

    python -m fedsim.scale --sites 16 --duration-s 600 [--rate-per-site 2.5] [--profile]

Runs `sites` sites (the study's unequal mix, 5-150 ms round trips, the 8B shape) under
ShareGPT-like Poisson arrivals at `rate-per-site` x sites for `duration-s` simulated seconds,
routed by completion_cost, and prints the wall time, steps, requests and events; --profile adds
where the time goes (cProfile, by function, and the share inside site_engine.engine.core).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Sequence

from fedsim.federation import run
from fedsim.gateway import GatewaySettings
from fedsim.study import Case, _mixed, _spread
from fedsim.workload import WorkloadSpec, build


def measure(
    sites: int, duration_s: float, rate_per_site: float, profile: bool
) -> dict[str, object]:
    case = Case(f"scale{sites}", _mixed(sites), _spread(sites))
    requests = build(WorkloadSpec(rate=rate_per_site * sites, duration_s=duration_s, seed=0))
    profiler = cProfile.Profile() if profile else None
    began, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    result = run(case.sites(), requests, GatewaySettings(policy="completion_cost"), drain_s=60.0)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - began
    cpu = time.process_time() - cpu
    out: dict[str, object] = {
        "sites": sites,
        "simulated_traffic_s": duration_s,
        "requests": result.requests,
        "steps": result.steps,
        "events": result.events,
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_step_us": 1e6 * cpu / max(result.steps, 1),
        "wall_per_step_us": 1e6 * wall / max(result.steps, 1),
        "summary": result.summary(),
    }
    if profiler is not None:
        stats = pstats.Stats(profiler)
        total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
        core = sum(
            v[2]
            for k, v in stats.stats.items()  # type: ignore[attr-defined]
            if "site_engine/engine/core" in k[0]
        )
        out["engine_core_share"] = core / total if total else 0.0
        stream = io.StringIO()
        stats.stream = stream  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(12)
        out["profile"] = stream.getvalue()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.scale")
    parser.add_argument("--sites", type=int, nargs="*", default=[16])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate-per-site", type=float, default=2.5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    for sites in args.sites:
        row = measure(sites, args.duration_s, args.rate_per_site, args.profile)
        profile = row.pop("profile", None)
        print(json.dumps(row), flush=True)
        if profile:
            print(profile, flush=True)


if __name__ == "__main__":
    main()
