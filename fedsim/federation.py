"""One simulated federation run: sites, gateway, workload, failures; and what came of it
(TTFT, TPOT, goodput at the SLO)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from fedsim.events import EventLoop
from fedsim.gateway import Flight, GatewaySettings, SimGateway
from fedsim.site import SimSite, SiteSpec
from fedsim.workload import SimRequest
from gateway.routing.hold_order import max_inversions, most_overtaken


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_s: float = 2.0
    tpot_p99_s: float = 0.1


@dataclass(frozen=True, slots=True)
class Failure:
    site: str
    at_s: float


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request's fate at the gateway: the site that finished it (its last), TTFT and TPOT
    as a client sees them (None: no first token, or not finished)."""

    request_id: str
    site: str
    completed: bool
    ttft_s: float | None
    tpot_s: float | None
    produced: int
    first_site: str = ""  # where routing placed it first (offload and failover move it)


@dataclass(frozen=True, slots=True)
class RunResult:
    requests: int
    completed: int
    rejected: int
    ttft_s: tuple[float, ...]  # of completed requests, in arrival order
    tpot_s: tuple[float, ...]  # of completed requests with more than one token
    offloads: int
    failovers: int
    steps: int
    events: int
    sim_s: float
    site_busy: dict[str, float] = field(default_factory=dict)
    # Every request in arrival order (bench.federation_real compares them with a real run's).
    outcomes: tuple[RequestOutcome, ...] = ()
    # Per site: prompt tokens looked up in the prefix cache at admission, and those found.
    prefix_query_tokens: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)
    # Arrival to last token of each completed request, and when it ended, in arrival order.
    latency_s: tuple[float, ...] = ()
    finished_at_s: tuple[float, ...] = ()
    # Held in the gateway's queue: how many, how many of them it gave up on, the longest hold.
    held: int = 0
    held_rejected: int = 0
    held_max_s: float = 0.0
    # The most later arrivals of its class admitted ahead of a request: per site (its waiting
    # queue), and in the gateway's queue.
    site_overtakes: dict[str, int] = field(default_factory=dict)
    gateway_overtakes: int = 0
    # Answer tokens the gateway received in each second of simulated time.
    tokens_per_second: dict[int, int] = field(default_factory=dict)
    # Per site: adapter reads from disk started, and distinct adapters its requests named.
    adapter_loads: dict[str, int] = field(default_factory=dict)
    adapters_served: dict[str, int] = field(default_factory=dict)
    # Steps each site ran; the gateway loop's busy seconds and the chunks it streamed (with
    # GatewaySettings.serving; 0 without).
    site_steps: dict[str, int] = field(default_factory=dict)
    gateway_cpu_s: float = 0.0
    gateway_chunks: int = 0
    # Of those, the chunks that reached a client with text (SiteSpec.text_share): what a client
    # counts.
    client_chunks: int = 0

    def token_rate(self, start_s: int, end_s: int) -> float:
        """Answer tokens per second received in [start_s, end_s)."""
        seconds = range(start_s, end_s)
        return sum(self.tokens_per_second.get(t, 0) for t in seconds) / max(len(seconds), 1)

    def percentile(self, values: Sequence[float], q: float) -> float:
        return percentile(values, q)

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttft_s, 0.5)

    @property
    def ttft_p99(self) -> float:
        return percentile(self.ttft_s, 0.99)

    @property
    def tpot_p50(self) -> float:
        return percentile(self.tpot_s, 0.5)

    @property
    def tpot_p99(self) -> float:
        return percentile(self.tpot_s, 0.99)

    @property
    def mean_latency(self) -> float:
        return sum(self.latency_s) / len(self.latency_s) if self.latency_s else math.inf

    @property
    def ttft_mean(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else math.inf

    def meets(self, slo: Slo) -> bool:
        """Every request served (none rejected or unfinished) and both p99s within the SLO."""
        if self.completed < self.requests:
            return False
        return self.ttft_p99 <= slo.ttft_p99_s and self.tpot_p99 <= slo.tpot_p99_s

    def summary(self) -> dict[str, float | int]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "ttft_p50_s": self.ttft_p50,
            "ttft_p99_s": self.ttft_p99,
            "tpot_p50_s": self.tpot_p50,
            "tpot_p99_s": self.tpot_p99,
            "mean_latency_s": self.mean_latency,
            "offloads": self.offloads,
            "failovers": self.failovers,
            "steps": self.steps,
            "held": self.held,
            "held_rejected": self.held_rejected,
            "held_max_s": self.held_max_s,
            "site_overtakes_max": max(self.site_overtakes.values(), default=0),
            "gateway_overtakes_max": self.gateway_overtakes,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; inf for no values (nothing served is no latency met)."""
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run(
    specs: Sequence[SiteSpec],
    requests: Sequence[SimRequest],
    settings: GatewaySettings,
    failures: Sequence[Failure] = (),
    drain_s: float = 60.0,
    capacity_weights: Sequence[float] | None = None,
    give_up: Slo | None = None,
) -> RunResult:
    """Every request arrives, the federation runs until they finish or `drain_s` after the last
    arrival; requests unfinished then count as not completed. `give_up`: stop as soon as more
    than 1% of the requests have waited longer than its TTFT for a first token (the run cannot
    meet it any more: an overloaded run would otherwise cost the most to simulate)."""
    loop = EventLoop()
    gateway: SimGateway | None = None

    def on_updates(site: SimSite, updates: Sequence[object]) -> None:
        assert gateway is not None
        gateway.on_updates(site, updates)  # type: ignore[arg-type]

    sites = [SimSite(spec, loop, on_updates) for spec in specs]
    gateway = SimGateway(loop, sites, settings, capacity_weights)
    last = max((r.arrival_s for r in requests), default=0.0)
    horizon = last + drain_s
    gateway.start(requests, horizon)
    for failure in failures:
        loop.at(failure.at_s, partial(gateway.fail, failure.site))
    if give_up is not None:
        loop.at(1.0, partial(_watch, loop, gateway, give_up, len(requests)))
    loop.run(horizon)
    return _result(gateway, sites, loop, horizon)


def _watch(loop: EventLoop, gateway: SimGateway, slo: Slo, total: int) -> None:
    now = loop.now()
    late = 0
    for flight in gateway.flights.values():
        first = flight.first_token_s
        waited = (now if first is None else first) - flight.request.arrival_s
        late += waited > slo.ttft_p99_s or flight.rejected
    if late > 0.01 * total:
        loop.stop()
        return
    loop.after(1.0, partial(_watch, loop, gateway, slo, total))


def _result(
    gateway: SimGateway, sites: Sequence[SimSite], loop: EventLoop, horizon: float
) -> RunResult:
    flights: list[Flight] = list(gateway.flights.values())
    done = [f for f in flights if f.finished_s is not None and f.first_token_s is not None]
    ttft = tuple(f.first_token_s - f.request.arrival_s for f in done)  # type: ignore[operator]
    latency = tuple(f.finished_s - f.request.arrival_s for f in done)  # type: ignore[operator]
    held = [f for f in flights if f.held_s is not None]
    tpot = tuple(
        (f.finished_s - f.first_token_s) / (f.produced - 1)  # type: ignore[operator]
        for f in done
        if f.produced > 1
    )
    outcomes = tuple(_outcome(f) for f in flights)
    stats = {s.name: s.scheduler.stats() for s in sites}
    return RunResult(
        requests=len(flights),
        completed=len(done),
        rejected=sum(f.rejected for f in flights),
        ttft_s=ttft,
        tpot_s=tpot,
        offloads=gateway.offloads,
        failovers=gateway.failovers,
        steps=sum(s.steps for s in sites),
        events=loop.events_run,
        sim_s=horizon,
        site_busy={s.name: s.busy_s for s in sites},
        latency_s=latency,
        finished_at_s=tuple(f.finished_s for f in done),  # type: ignore[misc]
        held=len(held),
        held_rejected=sum(f.rejected for f in held),
        held_max_s=max((f.held_s or 0.0 for f in held), default=0.0),
        site_overtakes={s.name: max_inversions(s.admissions) for s in sites},
        gateway_overtakes=most_overtaken(gateway.held_served),
        tokens_per_second=dict(gateway.tokens_per_second),
        outcomes=outcomes,
        prefix_query_tokens={name: st.prefix_cache_queries for name, st in stats.items()},
        prefix_hit_tokens={name: st.prefix_cache_hits for name, st in stats.items()},
        adapter_loads={s.name: s.adapter_loads for s in sites},
        adapters_served={s.name: len(s.adapters_served) for s in sites},
        site_steps={s.name: s.steps for s in sites},
        gateway_cpu_s=gateway.path.gateway.busy_s if gateway.path is not None else 0.0,
        gateway_chunks=gateway.path.chunks if gateway.path is not None else 0,
        client_chunks=gateway.text_chunks,
    )


def _outcome(flight: Flight) -> RequestOutcome:
    first, end = flight.first_token_s, flight.finished_s
    arrival = flight.request.arrival_s
    done = end is not None and first is not None
    tpot = None
    if done and first is not None and end is not None:
        tpot = (end - first) / (flight.produced - 1) if flight.produced > 1 else 0.0
    return RequestOutcome(
        flight.request.request_id,
        flight.site,
        done,
        None if first is None else first - arrival,
        tpot,
        flight.produced,
        flight.sites[0] if flight.sites else "",
    )
