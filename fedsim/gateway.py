"""The simulated gateway: the gateway's own routing state and code on the virtual clock.

Each site is a real `SiteState` (gateway/sites/registry.py: its ledger, load reports, step-time
and prefill-rate estimators, prefix index, adapter residency) whose clock is the simulation's;
each request is placed by a real routing profile (gateway/routing/policy.py: build_policy), is
counted on its site by a real `SiteLease` (prompt + planned answer left, recharged as tokens
stream back, as gateway/dispatch/stream.py does), and queued work moves by the real offload
planner (gateway/admin/offload.py: plan_offloads; its coordinator's timing: fedsim/offload.py).
What travels is delayed by half the site's round trip each way: the request to the site, its
tokens and its load reports back.

When every site pushes back (each one's queue at the gateway's bound), a new request is held
in the gateway's queue (GATEWAY_QUEUE_MAX_REQUESTS > 0) and offered to the sites again every
GATEWAY_QUEUE_POLL_MS in the queue's order (gateway/routing/hold_order.py: `offer`, the same
pass gateway/request_path/hold.py makes), until a site takes it or GATEWAY_QUEUE_TIMEOUT_S
passes (then it is rejected, the 503); with no queue it is rejected at once.

With `GatewaySettings.serving` (fedsim/serving_path.py) the gateway's event loop is a CPU whose
work queues: a request is routed once the loop has admitted it, an answer's tokens are paced
into chunks at the site (fedsim/site_writer.py) and at the gateway and reach the client once the
loop has streamed them, and a site's tokens leave it once its serving thread has written them;
a client's first token is the first chunk with text (SiteSpec.text_share). Without it (the
default) all of that takes no time.

Failover: a site that dies loses its requests; each is placed again among the others with its
prompt plus what it had generated as the new prompt and the rest of its answer to go (the
gateway's continuation, gateway/dispatch/continuation.py); the health monitor marks the site
down at its next check (GATEWAY_HEALTH_INTERVAL_S).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from random import Random
from typing import cast

from fedsim.events import EventLoop
from fedsim.offload import SimOffload
from fedsim.serving_path import ServingCosts, ServingPath, has_text
from fedsim.site import MODEL, SimSite
from fedsim.site_writer import SiteWriter
from fedsim.workload import SimRequest
from gateway.federation import SiteConfig
from gateway.queue_settings import QueueSettings
from gateway.routing.adapter_affinity import AdapterRouting
from gateway.routing.adapter_residency import SiteAdapters
from gateway.routing.hold_order import Held, HeldRequests, HoldOrder, offer, pushed_back
from gateway.routing.policy import RoutingPolicy, build_policy
from gateway.routing.types import RoutingRequest, UnpredictedPlan
from gateway.settings import OffloadSettings, RoutingSettings, SitesSettings
from gateway.sites.interface import ALL_CAPABILITIES, SiteClient
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteRegistry, SiteState
from site_engine.engine.core.outputs import NO_TOKEN, StepOutputs

_ROUTING, _SITES, _OFFLOAD, _QUEUE = (
    RoutingSettings(),
    SitesSettings(),
    OffloadSettings(),
    QueueSettings(),
)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The gateway's settings the simulation uses, at the product's defaults (gateway/settings.py
    and gateway/queue_settings.py: the routing policy is the product's default)."""

    policy: str = _ROUTING.policy
    adapter_routing: AdapterRouting = _ROUTING.adapter_routing
    unpredicted: UnpredictedPlan = _ROUTING.plan_without_prediction
    load_report_interval_s: float = _SITES.load_report_interval_ms / 1000.0
    health_interval_s: float = _SITES.health_interval_s
    site_max_queued_requests: int | None = _ROUTING.site_max_queued_requests or None
    offload: bool = _OFFLOAD.enabled
    offload_interval_s: float = _OFFLOAD.interval_s
    offload_transfer_cost_s: float = _OFFLOAD.transfer_cost_s
    # The gateway's queue (module docstring): how many it holds (0: none), for how long, in
    # which order, offered again how often.
    hold_requests: int = _QUEUE.max_requests
    hold_timeout_s: float = _QUEUE.timeout_s
    hold_order: HoldOrder = _QUEUE.hold_order
    hold_poll_s: float = _QUEUE.poll_ms / 1000.0
    # The serving path's CPU and chunk pacing (fedsim/serving_path.py); None: free and instant.
    serving: ServingCosts | None = None


class SimSiteClient:
    """What SiteState asks of its client in the simulation: capabilities, and whether the site
    hands queued requests back (our engines do). The requests themselves go to the SimSite."""

    capabilities = ALL_CAPABILITIES
    can_release_queued = True

    async def close(self) -> None:
        return None


@dataclass(slots=True)
class Flight:
    """One request's life at the gateway."""

    request: SimRequest
    routing: RoutingRequest
    lease: SiteLease | None = None
    site: str = ""
    first_token_s: float | None = None
    finished_s: float | None = None
    produced: int = 0
    rejected: bool = False
    moves: int = 0
    # The tokens produced on sites this request left (failover), already in `produced`.
    carried: int = 0
    # The routing's planned answer (routing.answer_tokens, a property: read once a placement).
    planned: int = 0
    sites: list[str] = field(default_factory=list)
    # Seconds it was held in the gateway's queue (None: never held).
    held_s: float | None = None


class SimGateway:
    def __init__(
        self,
        loop: EventLoop,
        sites: Sequence[SimSite],
        settings: GatewaySettings,
        capacity_weights: Sequence[float] | None = None,
    ) -> None:
        self._loop = loop
        self.settings = settings
        self.sites = {site.name: site for site in sites}
        weights = capacity_weights or [1.0] * len(sites)
        self.states: dict[str, SiteState] = {}
        for i, (site, weight) in enumerate(zip(sites, weights, strict=True)):
            spec = site.spec
            config = SiteConfig(spec.name, "sim", spec.region, f"sim:{i}", MODEL, weight)
            state = SiteState(
                config,
                i + 1,
                cast(SiteClient, SimSiteClient()),
                clock=loop.now,
                adapter_residency=SiteAdapters(clock=loop.now),
            )
            state.mark_healthy(site.info_view())
            state.rtt.observe(spec.rtt_s)
            self.states[spec.name] = state
        self.registry = SiteRegistry(self.states.values())
        self.policy: RoutingPolicy = build_policy(
            settings.policy,
            max_site_queue=settings.site_max_queued_requests,
            adapter_routing=settings.adapter_routing,
        )
        self.flights: dict[str, Flight] = {}
        self.offloads = 0
        rtts = {name: site.spec.rtt_s for name, site in self.sites.items()}
        moves = (settings.offload_interval_s, settings.offload_transfer_cost_s)
        self.offload = SimOffload(loop, self.states, self.sites, rtts, self._offloaded, *moves)
        self.failovers = 0
        self.held: HeldRequests[Flight] = HeldRequests(settings.hold_order)
        self.held_served: list[Held[Flight]] = []  # in the order sites took them
        # Answer tokens received per second of simulated time (the federation's throughput).
        self.tokens_per_second: dict[int, int] = {}
        self._offering = False
        self.path = ServingPath(loop, settings.serving, self._deliver) if settings.serving else None
        # Chunks that reached a client with text (what a client counts), and the draws of which.
        self.text_chunks = 0
        self._text_rng = Random(0)

    # -- requests -------------------------------------------------------------------------
    def start(self, requests: Sequence[SimRequest], horizon_s: float) -> None:
        for request in requests:
            self._loop.at(request.arrival_s, partial(self.arrive, request))
        interval = self.settings.load_report_interval_s
        for name in self.sites:
            self._loop.at(interval, partial(self._report, name, interval, horizon_s))
        if self.settings.offload:
            self.offload.start(horizon_s)
        if self.path is not None:
            self.path.start(horizon_s)

    def arrive(self, request: SimRequest) -> None:
        routing = RoutingRequest(
            model=MODEL,
            prompt_tokens=len(request.prompt),
            max_tokens=request.max_tokens,
            predicted_tokens=request.predicted,
            predicted_bucket=request.bucket,
            unpredicted=self.settings.unpredicted,
            prompt_token_ids=request.prompt,
            adapter=request.adapter or None,
        )
        flight = Flight(request, routing)
        self.flights[request.request_id] = flight
        if self.path is not None:
            self.path.admit(partial(self._route_new, flight))
        else:
            self._route_new(flight)

    def _route_new(self, flight: Flight) -> None:
        decision = self.policy.route(flight.routing, list(self.states.values()))
        if decision.site is not None:
            self._assign(flight, decision.site)
        elif pushed_back(decision) and len(self.held) < self.settings.hold_requests:
            self.held.hold(flight, flight.request.priority, flight.routing.answer_tokens)
            flight.held_s = 0.0
            if not self._offering:
                self._offering = True
                self._loop.after(self.settings.hold_poll_s, self._offer_held)
        else:
            self._reject(flight)

    def _offer_held(self) -> None:
        """The gateway queue's pass (gateway/routing/hold_order.py: offer), then its timeouts."""
        now = self._loop.now()
        states = list(self.states.values())

        def place(flight: Flight) -> bool:
            state = self.policy.route(flight.routing, states).site
            if state is None:
                return False
            flight.held_s = now - flight.request.arrival_s
            self._assign(flight, state)
            return True

        self.held_served += offer(self.held, place, lambda f: (f.routing.model, f.routing.adapter))
        for entry in self.held:
            if now - entry.item.request.arrival_s >= self.settings.hold_timeout_s:
                self.held.release(entry)
                entry.item.held_s = now - entry.item.request.arrival_s
                self._reject(entry.item)
        self._offering = bool(self.held)
        if self._offering:
            self._loop.after(self.settings.hold_poll_s, self._offer_held)

    def _reject(self, flight: Flight) -> None:
        """503: no site may take it now."""
        flight.rejected = True
        if flight.lease is not None:
            flight.lease.release()
        if self.path is not None:
            self.path.closed(flight.request.request_id)

    def _place(self, flight: Flight, candidates: Iterable[SiteState]) -> None:
        state = self.policy.route(flight.routing, list(candidates)).site
        if state is None:
            self._reject(flight)
            return
        self._assign(flight, state)

    def _assign(self, flight: Flight, state: SiteState) -> None:
        flight.planned = flight.routing.answer_tokens
        tokens = flight.routing.prompt_tokens + flight.planned
        if flight.lease is None:
            flight.lease = SiteLease.take(state, tokens)
            if self.path is not None:  # its answer streams (the pacer counts it) from now
                self.path.opened(flight.request.request_id)
        else:
            flight.lease.move(state, tokens)
        flight.site = state.name
        flight.sites.append(state.name)
        site = self.sites[state.name]
        # The message that starts it carries the gateway's chunk interval now (site_writer.py).
        interval = self.path.interval_s() if self.path is not None else 0.0
        self._loop.after(site.spec.rtt_s / 2, lambda: self._send(flight, site, interval))

    def _send(self, flight: Flight, site: SimSite, interval_s: float = 0.0) -> None:
        if self.path is not None and site.alive:
            self._writer(site).told(interval_s)
        if flight.site != site.name or flight.finished_s is not None:
            return
        if not site.alive:  # connection refused: another site at once
            self._loop.after(site.spec.rtt_s / 2, lambda: self._failover(flight, site.name))
            return
        r, routing = flight.request, flight.routing
        left = r.answer_tokens - flight.produced
        site.add(
            r.request_id + (f"~{flight.moves}" if flight.moves else ""),
            routing.prompt_token_ids,
            left,
            max(left, routing.max_tokens),
            routing.predicted_tokens,
            r.adapter,
            r.priority,
        )

    def on_updates(self, site: SimSite, updates: StepOutputs) -> None:
        """A site's step ended: its tokens reach the gateway half a round trip later; with the
        serving path, once its serving thread has written them and its writer's pacing lets
        them go (fedsim/site_writer.py)."""
        if not updates:
            return
        if self.path is None:
            self._loop.after(site.spec.rtt_s / 2, lambda: self._tokens(site.name, updates))
            return
        delay = self.path.site_delay(site.name, len(updates))
        self._loop.after(delay, lambda: self._writer(site).step(updates))

    def _writer(self, site: SimSite) -> SiteWriter:
        assert self.path is not None
        return self.path.writer(site.name, site.spec.rtt_s / 2, self._site_chunk)

    def _site_chunk(self, site: str, rid: str, tokens: int, finish: bool) -> None:
        """A chunk the site's writer sent reached the gateway."""
        assert self.path is not None
        flight = self.flights.get(rid) or self.flights.get(rid.split("~")[0])
        if flight is None or flight.site != site or flight.finished_s is not None:
            return
        self.path.arrived(flight.request.request_id, tokens, finish)

    def _tokens(self, site: str, updates: StepOutputs) -> None:
        """Without the serving path: each token reaches the client as it reaches the gateway."""
        flights = self.flights
        tokens, finished = updates.tokens, updates.finished
        for index, rid in enumerate(updates.request_ids):
            flight = flights.get(rid) or flights.get(rid.split("~")[0])
            if flight is None or flight.site != site or flight.finished_s is not None:
                continue
            finish = finished.get(index)
            if finish is not None and finish[0].value == "released":
                continue  # handled by the offload that asked for it
            self._delivered(flight, int(tokens[index] != NO_TOKEN), finish is not None)

    def _deliver(self, request_id: str, tokens: int, finish: bool) -> None:
        """A chunk the gateway's loop streamed reached the client (ServingPath): whether it
        shows text is drawn from its site's text share (serving_path.has_text)."""
        flight = self.flights[request_id]
        if flight.finished_s is None:
            share = self.sites[flight.site].spec.text_share if flight.site else 1.0
            text = has_text(self._text_rng, share, tokens)
            self.text_chunks += text
            self._delivered(flight, tokens, finish, text)
        if finish and self.path is not None:
            self.path.closed(request_id)

    def _delivered(self, flight: Flight, tokens: int, finish: bool, text: bool = True) -> None:
        """The client has `tokens` more of the answer (and its end): the lease follows, as the
        gateway's stream recharges it at each chunk and gives it back at the end. Its first
        token is the first chunk with text, as a client sees it (`text`)."""
        now = self._loop.now()
        if tokens:
            flight.produced += tokens
            second = int(now)
            self.tokens_per_second[second] = self.tokens_per_second.get(second, 0) + tokens
            if flight.first_token_s is None and text:
                flight.first_token_s = now
        lease = flight.lease
        if finish:
            flight.finished_s = now
            if lease is not None:
                lease.release()
        elif lease is not None:
            left = max(flight.planned - flight.produced + flight.carried, 0)
            lease.recharge(flight.routing.prompt_tokens + left)

    # -- load reports, offload, failures --------------------------------------------------
    def _report(self, name: str, interval: float, horizon_s: float) -> None:
        site = self.sites[name]
        if site.alive:
            view = site.load_view()
            state = self.states[name]

            def deliver() -> None:
                state.apply_report(view)
                if view.cache_events is not None:
                    state.prefix.apply(view.cache_events)

            self._loop.after(site.spec.rtt_s / 2, deliver)
        if self._loop.now() + interval <= horizon_s:
            self._loop.after(interval, lambda: self._report(name, interval, horizon_s))

    def _offloaded(self, request_id: str, giver: str) -> None:
        """A request the giver released reached the gateway: placed again, never on the giver
        (gateway/dispatch/stream.py); counted as the gateway counts it, once it has a site."""
        flight = self.flights.get(request_id.split("~")[0])
        if flight is None or flight.finished_s is not None:
            return
        flight.moves += 1
        self._place(flight, [s for s in self.states.values() if s.name != giver])
        self.offloads += not flight.rejected

    def fail(self, name: str) -> None:
        """Site `name` dies now: its streams break (seen half a round trip later), the health
        monitor marks it down at its next check."""
        site = self.sites[name]
        lost = site.fail()
        if self.path is not None and name in self.path.writers:
            self.path.writers[name].clear()
        for request_id in lost:
            flight = self.flights.get(request_id.split("~")[0])
            if flight is not None and flight.site == name:
                self._loop.after(site.spec.rtt_s / 2, partial(self._failover, flight, name))
        interval = self.settings.health_interval_s
        next_check = (self._loop.now() // interval + 1) * interval
        self._loop.at(next_check, lambda: self.states[name].mark_unhealthy("sim: site failed"))

    def _failover(self, flight: Flight, dead: str) -> None:
        if flight.finished_s is not None:
            return
        self.failovers += 1
        flight.moves += 1
        r = flight.request
        produced = flight.produced
        flight.carried = produced
        prompt = r.prompt + tuple(range(2, 2 + produced))  # the answer so far, continued
        left = max(r.answer_tokens - produced, 1)
        flight.routing = RoutingRequest(
            model=MODEL,
            prompt_tokens=len(prompt),
            max_tokens=max(r.max_tokens - produced, left),
            predicted_tokens=None if r.predicted is None else max(r.predicted - produced, 1),
            predicted_bucket=r.bucket,
            unpredicted=self.settings.unpredicted,
            prompt_token_ids=prompt,
            adapter=r.adapter or None,
        )
        self._place(flight, [s for s in self.states.values() if s.name != dead])
