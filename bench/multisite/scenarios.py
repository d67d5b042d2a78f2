"""Scenarios MICO did not measure, on iteration-level sites behind the real gateway:

- skewed: the longest answers arrive in bursts (round robin vs token-balanced, online and,
  when the gateway serves it, through the batch API);
- unequal capacity: one site with twice the batch slots and capacity weight 2 (round robin,
  which cannot use weights, vs token-balanced, which divides load by them; online and batch);
- slowed site: one site is throttled to a fraction of its speed once the run is under way;
  offload off vs on: the time saved and how many requests moved;
- site loss: a site is killed mid-run: how many requests completed anyway, and whether any that
  were still queued there were lost.

The last two route round robin: every site then holds a third of the burst when the slowdown or
the kill comes, whatever the token balancer would have done (online token balancing herds under
a burst, see docs/multisite-bench.md), so they measure offload and failover, not routing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bench.multisite.bad_input import serves_batches
from bench.multisite.cluster import Gateway, SiteSpec, site_specs
from bench.multisite.metrics import RunResult, imbalance, ratio
from bench.multisite.records import Recorded, difference, read_records
from bench.multisite.replay import Outcome
from bench.multisite.runner import Bench
from bench.multisite.throttle import Throttle
from bench.multisite.workload import Query

EQUAL_MODEL = "tiny-equal"
UNEQUAL_MODEL = "tiny-unequal"
OFFLOAD_ENV = {
    "GATEWAY_OFFLOAD_ENABLED": "true",
    "GATEWAY_OFFLOAD_INTERVAL_S": "0.25",
    "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
}
# The batch API columns are MICO's group-wise assignment: the batch plan's longest_first order
# (the default, blend, spreads a batch by its prefix tree instead; bench/engine/batch_order.py).
NO_OFFLOAD_ENV = {
    "GATEWAY_OFFLOAD_ENABLED": "false",
    "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
    "GATEWAY_BATCH_ORDER": "longest_first",
}


@dataclass(frozen=True, slots=True)
class ScenarioSettings:
    max_batch: int
    sites: int = 3
    slowdown_stopped_share: float = 0.8  # the slowed site runs 20% of the time
    slow_after_share: float = 0.1  # throttling starts once this share of answers is back
    kill_after_share: float = 0.25


def unequal_specs(max_batch: int, smaller: int) -> list[SiteSpec]:
    """One site with twice the batch slots (capacity weight 2) and `smaller` equal ones."""
    big = site_specs(UNEQUAL_MODEL, "fcfs", 1, 2 * max_batch, prefix="big")[0]
    small = site_specs(UNEQUAL_MODEL, "fcfs", smaller, max_batch, prefix="small")
    return [SiteSpec(big.name, big.model, big.policy, big.max_batch, big.port, 2.0), *small]


def _after_share(
    queries: int, share: float, action: Callable[[], None]
) -> Callable[[Outcome], None]:
    """A completion callback that runs `action` once `share` of the answers are back."""
    threshold = max(1, round(share * queries))
    seen = [0]

    def on_done(outcome: Outcome) -> None:
        seen[0] += 1
        if seen[0] == threshold:
            action()

    return on_done


def _compare(base: RunResult, *others: RunResult) -> dict[str, object]:
    """Each other run against `base` (round robin): makespan ratios, and everyone's imbalance."""
    return {
        "speedup_iterations": {
            o.config: round(ratio(base.makespan_iterations, o.makespan_iterations), 4)
            for o in others
        },
        "speedup_wall": {o.config: round(ratio(base.wall_s, o.wall_s), 4) for o in others},
        "imbalance": {r.config: round(r.imbalance, 4) for r in (base, *others)},
        "runs": [r.summary() for r in (base, *others)],
    }


def _records(bench: Bench, gateway: Gateway) -> Recorded:
    return read_records(bench.cluster.database_url(gateway.name))


def run_scenarios(
    bench: Bench,
    settings: ScenarioSettings,
    queries: Sequence[Query],
    skewed_queries: Sequence[Query],
    dead_sites: Sequence[SiteSpec] = (),
    extra_env: Mapping[str, str] | None = None,
) -> tuple[dict[str, object], dict[str, Gateway]]:
    """Runs every scenario; returns the results and leaves the gateways running (the caller
    runs the bad-input checks on them, then closes the cluster)."""
    equal = site_specs(EQUAL_MODEL, "fcfs", settings.sites, settings.max_batch, prefix="equal")
    unequal = unequal_specs(settings.max_batch, settings.sites - 1)
    everyone = [*equal, *unequal, *dead_sites]
    cluster = bench.cluster
    cluster.start_sites([*equal, *unequal])

    def gateway(name: str, policy: str, env: Mapping[str, str]) -> Gateway:
        return cluster.start_gateway(
            f"scenario-{name}",
            policy,
            everyone,
            predictor_dir=bench.predictor_dir,
            env={**env, **(extra_env or {})},
            expect_healthy=len(equal) + len(unequal),
        )

    # The offload gateway starts only when its runs come: its coordinator would otherwise
    # release queued requests that other gateways sent to a busy site (any gateway may).
    gateways = {
        "rr": gateway("rr", "round_robin", NO_OFFLOAD_ENV),
        "mico": gateway("mico", "mico", NO_OFFLOAD_ENV),
    }
    if bench.batch_api is None:
        bench.batch_api = serves_batches(gateways["mico"].base_url)
    results: dict[str, object] = {}
    bench.log(f"scenario: skewed arrivals, {len(equal)} equal sites")
    rr = bench.run("rr_iter", gateways["rr"], EQUAL_MODEL, equal, skewed_queries)
    mico = bench.run("mico", gateways["mico"], EQUAL_MODEL, equal, skewed_queries)
    runs = [mico, *_batch_run(bench, gateways["mico"], EQUAL_MODEL, equal, skewed_queries)]
    results["skewed"] = _compare(rr, *runs)

    bench.log("scenario: unequal capacity (one site with twice the slots, weight 2)")
    rr = bench.run("rr_iter", gateways["rr"], UNEQUAL_MODEL, unequal, queries)
    mico = bench.run("mico", gateways["mico"], UNEQUAL_MODEL, unequal, queries)
    runs = [mico, *_batch_run(bench, gateways["mico"], UNEQUAL_MODEL, unequal, queries)]
    weights = {s.name: s.capacity_weight for s in unequal}
    results["unequal_capacity"] = {
        "sites": {
            s.name: {"max_batch": s.max_batch, "capacity_weight": s.capacity_weight}
            for s in unequal
        },
        "imbalance_per_capacity": {
            run.config: round(imbalance_per_capacity(run, weights), 4) for run in (rr, *runs)
        },
        **_compare(rr, *runs),
    }

    results["slowed_site"] = _slowed(bench, gateways, equal, queries, settings, gateway)
    results["site_loss"] = _site_loss(bench, gateways["rr_offload"], equal, queries, settings)
    return results, gateways


def _batch_run(
    bench: Bench, gateway: Gateway, model: str, sites: Sequence[SiteSpec], queries: Sequence[Query]
) -> list[RunResult]:
    """The same queries as one batch (group-wise assignment), when the gateway serves batches."""
    if not bench.batch_api:
        return []
    return [bench.run("mico_batch", gateway, model, sites, queries, submission="batch")]


def imbalance_per_capacity(run: RunResult, weights: Mapping[str, float]) -> float:
    """max/mean of the tokens served per unit of capacity weight: 1.0 when every site got its
    share in proportion to its capacity."""
    per_capacity = [run.tokens_served.get(name, 0) / w for name, w in weights.items()]
    return imbalance([round(1000 * v) for v in per_capacity])


def _slowed(
    bench: Bench,
    gateways: dict[str, Gateway],
    equal: Sequence[SiteSpec],
    queries: Sequence[Query],
    settings: ScenarioSettings,
    start_gateway: Callable[[str, str, Mapping[str, str]], Gateway],
) -> dict[str, object]:
    slow = equal[-1]
    process = bench.cluster.sites[slow.name]
    bench.log(
        f"scenario: {slow.name} slowed to {1 - settings.slowdown_stopped_share:.0%} of its speed "
        f"after {settings.slow_after_share:.0%} of the answers"
    )
    runs: dict[str, RunResult] = {}
    moved: dict[str, int] = {}
    for key in ("rr", "rr_offload"):
        if key not in gateways:
            gateways[key] = start_gateway(key, "round_robin", OFFLOAD_ENV)
        gateway = gateways[key]
        throttle = Throttle((process.popen.pid,), settings.slowdown_stopped_share)
        before = _records(bench, gateway)
        try:
            runs[key] = bench.run(
                key,
                gateway,
                EQUAL_MODEL,
                equal,
                queries,
                on_done=_after_share(len(queries), settings.slow_after_share, throttle.start),
            )
        finally:
            throttle.stop()
        moved[key] = difference(_records(bench, gateway), before).moved_requests
    off, on = runs["rr"], runs["rr_offload"]
    return {
        "slowed_site": slow.name,
        "speed_while_slowed": round(1 - settings.slowdown_stopped_share, 3),
        "slowed_after_share_of_answers": settings.slow_after_share,
        "offload_gain_wall": round(ratio(off.wall_s, on.wall_s), 4),
        "offload_gain_iterations": round(ratio(off.makespan_iterations, on.makespan_iterations), 4),
        "routing": "round_robin",
        "moved_requests": moved["rr_offload"],
        "moved_requests_offload_off": moved["rr"],
        "slowed_site_queries": {
            "offload_off": off.queries_served.get(slow.name, 0),
            "offload_on": on.queries_served.get(slow.name, 0),
        },
        "runs": [off.summary(), on.summary()],
    }


def _site_loss(
    bench: Bench,
    gateway: Gateway,
    equal: Sequence[SiteSpec],
    queries: Sequence[Query],
    settings: ScenarioSettings,
) -> dict[str, object]:
    lost = equal[-1]
    process = bench.cluster.sites[lost.name]
    bench.log(f"scenario: {lost.name} killed after {settings.kill_after_share:.0%} of the answers")
    before = _records(bench, gateway)
    run = bench.run(
        "rr_offload",
        gateway,
        EQUAL_MODEL,
        equal,
        queries,
        on_done=_after_share(len(queries), settings.kill_after_share, process.kill),
        counted_sites=equal[:-1],
    )
    recorded = difference(_records(bench, gateway), before)
    bench.cluster.stop_sites([lost.name])
    return {
        "killed_site": lost.name,
        "killed_after_share_of_answers": settings.kill_after_share,
        "routing": "round_robin, offload on",
        "answered_by_killed_site_before": run.queries_served.get(lost.name, 0),
        "queries": run.queries,
        "completed": run.completed,
        "failed": run.failed,
        "failed_while_queued": recorded.failed_before_first_token,
        "failed_mid_answer": recorded.failed - recorded.failed_before_first_token,
        "moved_requests": recorded.moved_requests,
        # Started again elsewhere: offloaded before the kill, or failed over after it.
        "restarted_elsewhere": recorded.retried_requests,
        "no_queued_request_lost": recorded.failed_before_first_token == 0,
        "errors": list(run.errors[:5]),
        "run": run.summary(),
    }
