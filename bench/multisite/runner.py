"""One measured run: wait until the sites are idle, hold them (see hold.py), submit the queries,
read the counters once everything is queued, release, wait for every answer, read the counters
again, and turn the differences into a RunResult."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.multisite.cluster import Cluster, Gateway, SiteSpec
from bench.multisite.counters import SiteCounters, read_counters, settled_counters
from bench.multisite.hold import Hold
from bench.multisite.metrics import RunResult, build_run
from bench.multisite.replay import (
    BatchApiError,
    BurstResult,
    Outcome,
    Submission,
    batch,
    burst,
)
from bench.multisite.workload import Query


@dataclass
class Bench:
    """What every phase shares: the cluster, the predictor it serves, and how runs start."""

    cluster: Cluster
    predictor_dir: Path | None
    log: Callable[[str], None]
    max_model_len: int
    hold: bool = True  # False: the run starts with the first arrival (arrival time included)
    # Whether the gateways serve /v1/batches; None until the first gateway was asked.
    batch_api: bool | None = None

    def run(
        self,
        config: str,
        gateway: Gateway,
        model: str,
        sites: Sequence[SiteSpec],
        queries: Sequence[Query],
        *,
        on_done: Callable[[Outcome], None] | None = None,
        extra: Mapping[str, object] | None = None,
        counted_sites: Sequence[SiteSpec] | None = None,
        submission: Submission = "burst",
    ) -> RunResult:
        """Runs the queries on `gateway` for `model` (served by `sites`, all held); the
        counters of `counted_sites` (default: `sites`) are read, e.g. all but one that will be
        killed."""
        counted = list(counted_sites or sites)
        started = time.perf_counter()
        result, deltas, notes = asyncio.run(
            self._measure(gateway, model, list(sites), counted, queries, on_done, submission)
        )
        run = build_run(
            config,
            max_batch=max(s.max_batch for s in sites),
            outcomes=result.outcomes,
            wall_s=result.wall_s,
            counters=deltas,
            extra={**notes, "submission": submission, **(extra or {})},
        )
        self.log(
            f"  {config:<18} {len(sites)} sites, batch {run.max_batch}: "
            f"{run.completed}/{run.queries} ok, makespan {run.makespan_iterations} iterations, "
            f"{run.wall_s:.1f}s wall, imbalance {run.imbalance:.2f} "
            f"({time.perf_counter() - started:.0f}s)"
        )
        return run

    async def _measure(
        self,
        gateway: Gateway,
        model: str,
        held: list[SiteSpec],
        counted: list[SiteSpec],
        queries: Sequence[Query],
        on_done: Callable[[Outcome], None] | None,
        submission: Submission,
    ) -> tuple[BurstResult, dict[str, SiteCounters], dict[str, object]]:
        endpoints = {s.name: s.endpoint for s in counted}
        before = await settled_counters({s.name: s.endpoint for s in held})
        pids = {s.name: self.cluster.sites[s.name].popen.pid for s in held}
        # The hold waits until every query is queued at a site before the sites run. The batch
        # API feeds a site only as much as its idle slots take (gateway/batches/feed.py), so a
        # batch is never all queued at once: its column runs without the hold, its makespan
        # counted from submission.
        held_run = self.hold and submission != "batch"
        hold = Hold(held, pids, self.max_model_len) if held_run else None
        if hold is not None:
            await hold.engage()
        submitted = time.perf_counter()
        if submission == "batch":
            task = asyncio.create_task(_batch_or_failure(gateway.base_url, model, queries))
        else:
            task = asyncio.create_task(burst(gateway.base_url, model, queries, on_done=on_done))
        notes: dict[str, object] = {}
        if hold is not None:
            try:
                await hold.wait_queued(len(queries), task)
                before = await read_counters(endpoints)
            finally:
                await hold.release()
            notes["queueing_s"] = round(time.perf_counter() - submitted, 3)
            notes["hold_leaked"] = hold.leaked
        released = time.perf_counter()
        result = await task
        finished = time.perf_counter()
        after = await settled_counters(endpoints)
        deltas = {name: after[name].minus(before[name]) for name in endpoints}
        return BurstResult(result.outcomes, finished - released), deltas, notes


async def _batch_or_failure(base_url: str, model: str, queries: Sequence[Query]) -> BurstResult:
    """A refused or broken batch is a measured failure of that column, not of the benchmark."""
    started = time.perf_counter()
    try:
        return await batch(base_url, model, queries)
    except (BatchApiError, httpx.HTTPError, KeyError, ValueError) as exc:
        wall = time.perf_counter() - started
        error = f"batch API: {type(exc).__name__}: {exc}"[:300]
        return BurstResult(tuple(Outcome(q.id, 0, None, 0, 0, wall, error) for q in queries), wall)
