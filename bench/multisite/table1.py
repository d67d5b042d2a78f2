"""MICO's Table 1 on real processes: four configurations at each (sites, max batch) point.

For one maximum batch size, the largest number of sites is specified up front for both engine
policies (static and iteration-level sites serve different model names), and two gateways are
started, round robin and token-balanced (MICO), each with a federation naming every site. Sites
are then started in steps (2, then 3, 6, 9): at each step both gateways see the new sites, and
the four configurations run one after the other on exactly the same queries. Offload is off
here: Table 1 compares the four configurations alone; offload is measured in the scenarios.

Extra columns run next to the four: the same queries through the batch API (group-wise MICO
assignment over the whole batch), and the predictor ablation's arms, each on its own gateway
or sharing one of the four's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bench.multisite.bad_input import serves_batches
from bench.multisite.cluster import Gateway, SiteSpec, site_specs
from bench.multisite.metrics import CONFIGS, Cell, RunResult
from bench.multisite.replay import Submission
from bench.multisite.runner import Bench
from bench.multisite.workload import Query

STATIC_MODEL = "tiny-static"
ITER_MODEL = "tiny-iter"
# The batch API columns are MICO's group-wise assignment: the batch plan's longest_first order
# (the default, blend, spreads a batch by its prefix tree instead; bench/engine/batch_order.py).
NO_OFFLOAD = {"GATEWAY_OFFLOAD_ENABLED": "false", "GATEWAY_BATCH_ORDER": "longest_first"}


@dataclass(frozen=True, slots=True)
class Extra:
    """An additional column: `routing_policy` on iteration-level or static sites. `shares`
    names the gateway of the four configurations it runs on (by routing policy); None starts a
    gateway of its own (with or without the predictor). `site_counts` None: every cell."""

    key: str
    routing_policy: str
    engine_model: str  # STATIC_MODEL or ITER_MODEL
    with_predictor: bool = True
    submission: Submission = "burst"
    shares: str | None = None
    site_counts: frozenset[int] | None = None
    # More gateway settings for a gateway of its own (e.g. GATEWAY_PLAN_WITHOUT_PREDICTION).
    env: Mapping[str, str] = field(default_factory=dict)

    def runs_at(self, sites: int) -> bool:
        return self.site_counts is None or sites in self.site_counts


def model_of(engine_policy: str) -> str:
    return STATIC_MODEL if engine_policy == "static" else ITER_MODEL


def run_batch_size(
    bench: Bench,
    max_batch: int,
    site_counts: Sequence[int],
    queries: Sequence[Query],
    extras: Sequence[Extra] = (),
    dead_sites: Sequence[SiteSpec] = (),
    env: Mapping[str, str] = NO_OFFLOAD,
    on_gateways: Callable[[dict[str, Gateway]], None] | None = None,
) -> list[Cell]:
    """All cells of one maximum batch size with their extra columns; `on_gateways` then gets the
    live gateways (by routing policy or extra key) before everything of this batch size is
    stopped."""
    largest = max(site_counts)
    static = site_specs(STATIC_MODEL, "static", largest, max_batch, prefix=f"b{max_batch}-static")
    iteration = site_specs(ITER_MODEL, "fcfs", largest, max_batch, prefix=f"b{max_batch}-iter")
    everyone = [*static, *iteration, *dead_sites]
    cluster = bench.cluster
    first = min(site_counts)
    cluster.start_sites([*static[:first], *iteration[:first]])
    wanted = [e for e in extras if any(e.runs_at(n) for n in site_counts)]
    gateways: dict[str, Gateway] = {}
    try:
        for routing in sorted({c.routing_policy for c in CONFIGS}):
            gateways[routing] = cluster.start_gateway(
                f"b{max_batch}-{routing}",
                routing,
                everyone,
                predictor_dir=bench.predictor_dir,
                env=env,
                expect_healthy=2 * first,
            )
        for extra in wanted:
            gateways[extra.key] = (
                gateways[extra.shares]
                if extra.shares
                else (
                    cluster.start_gateway(
                        f"b{max_batch}-{extra.key}",
                        extra.routing_policy,
                        everyone,
                        predictor_dir=bench.predictor_dir if extra.with_predictor else None,
                        env={**env, **extra.env},
                        expect_healthy=2 * first,
                    )
                )
            )
        if bench.batch_api is None:
            bench.batch_api = serves_batches(gateways["mico"].base_url)
            bench.log(f"batch API served: {bench.batch_api}")
        if not bench.batch_api:
            wanted = [e for e in wanted if e.submission != "batch"]
        cells = []
        for count in sorted(site_counts):
            live = {STATIC_MODEL: static[:count], ITER_MODEL: iteration[:count]}
            cluster.start_sites([*live[STATIC_MODEL], *live[ITER_MODEL]])
            for gateway in {id(g): g for g in gateways.values()}.values():
                gateway.wait_for_sites(s.name for specs in live.values() for s in specs)
            bench.log(f"cell: {count} sites, max batch {max_batch}, {len(queries)} queries")
            runs: dict[str, RunResult] = {}
            for config in CONFIGS:
                model = model_of(config.engine_policy)
                gateway = gateways[config.routing_policy]
                runs[config.key] = bench.run(config.key, gateway, model, live[model], queries)
            for extra in (e for e in wanted if e.runs_at(count)):
                model = extra.engine_model
                runs[extra.key] = bench.run(
                    extra.key,
                    gateways[extra.key],
                    model,
                    live[model],
                    queries,
                    submission=extra.submission,
                )
            cells.append(Cell(count, max_batch, len(queries), runs))
        if on_gateways is not None:
            on_gateways(gateways)
        return cells
    finally:
        for gateway in {id(g): g for g in gateways.values()}.values():
            cluster.stop_gateway(gateway)
        cluster.stop_sites([s.name for s in (*static, *iteration)])
