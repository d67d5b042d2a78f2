"""The latency-aware policy decides in under 1 ms (p99) at 9 sites, on the gateway's own site
objects (bench.multisite.decision: SiteState with info and pushed load reports)."""

from __future__ import annotations

from bench.multisite.decision import time_decisions

BUDGET_MS = 1.0


def test_least_latency_decides_within_a_millisecond_at_nine_sites() -> None:
    # The bound is on the deciding thread's CPU time: on a shared CPU another process can
    # preempt a few hundred decisions of a run (wall p99 3 ms seen at load average 12), and a
    # preemption is not the policy's cost. Wall time must still be well under the bound at the
    # median (p50 is ~0.04 ms here).
    runs = [time_decisions(9, 3_000, seed, policies=("least_latency",))[0] for seed in range(3)]
    assert max(run.cpu_p99_ms for run in runs) < BUDGET_MS, [run.to_json() for run in runs]
    assert max(run.p50_ms for run in runs) < BUDGET_MS / 4, [run.to_json() for run in runs]
    assert all(run.sites == 9 and run.decisions == 3_000 for run in runs)
