"""The sweep of the prefix-reuse workloads: every arm at a few coarse rates, then its knee
bisected, so that each arm's goodput is located to within a few percent instead of a grid step.

1. Coarse rates in ascending order; an arm that missed the SLO at one rate is not run at higher
   ones (they count as missed: goodput takes the highest rate held with every lower one held).
2. `bisections` times, per arm: between the highest rate it held (0 if none) and the lowest it
   missed, the midpoint; an arm that never missed goes 1.5x past its highest rate.
Every arm at a rate sees the same requests (bench/federation/prefix_workloads.py: for_run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from bench.federation.cluster import Gateway
from bench.federation.metrics import RunSummary, goodput_rps
from bench.federation.runs import Runner
from bench.federation.workload import Request

RequestsAt = Callable[[float, str], Sequence[Request]]


def next_rate(runs: Sequence[RunSummary]) -> float | None:
    """Contract: the rate to bisect next for one arm's runs (step 2), rounded to 0.01; None when
    that rate was run already or there is no run."""
    if not runs:
        return None
    held = goodput_rps([(r.rate_rps, r.holds_slo) for r in runs])
    missed = [r.rate_rps for r in runs if not r.holds_slo and r.rate_rps > held]
    rate = round((held + min(missed)) / 2 if missed else 1.5 * held, 2)
    return None if rate <= 0 or rate in {r.rate_rps for r in runs} else rate


def knee_sweep(
    runner: Runner,
    arms: Sequence[Gateway],
    requests_at: RequestsAt,
    coarse: Sequence[float],
    bisections: int,
    checkpoint: Callable[[Mapping[str, list[RunSummary]]], None] | None = None,
) -> dict[str, list[RunSummary]]:
    results: dict[str, list[RunSummary]] = {g.arm.name: [] for g in arms}
    missed: set[str] = set()
    for rate in sorted(coarse):
        runner.log(f"rate {rate:g} rps")
        for gateway in arms:
            name = gateway.arm.name
            if name in missed:
                continue
            run = runner.run(gateway, rate, requests_at(rate, name))
            results[name].append(run)
            if not run.holds_slo:
                missed.add(name)
        if checkpoint is not None:
            checkpoint(results)
    for step in range(bisections):
        runner.log(f"bisection {step + 1} of {bisections}")
        for gateway in arms:
            name = gateway.arm.name
            bisected = next_rate(results[name])
            if bisected is not None:
                run = runner.run(gateway, bisected, requests_at(bisected, name))
                results[name].append(run)
                results[name].sort(key=lambda r: r.rate_rps)
        if checkpoint is not None:
            checkpoint(results)
    return results
