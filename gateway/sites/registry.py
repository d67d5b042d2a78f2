"""The gateway's live view of its sites: configuration, health and what each site reported."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from statistics import median_low

from gateway.federation import SiteConfig
from gateway.routing.adapter_residency import SiteAdapters
from gateway.routing.latency import RateEstimate, RttEstimator, StepTimeModel
from gateway.routing.prefix.site_prefix import DEFAULT_PREFIX_INDEX_BLOCKS, SitePrefix
from gateway.routing.types import SiteLatency, StepTime
from gateway.sites.interface import LoadView, SiteClient, SiteInfoView


@dataclass(slots=True)
class Arrivals:
    """The work admitted for one model since this gateway started, as routing planned it: every
    request's prompt tokens and predicted answer tokens, counted once when it is placed (moving
    it to another site later is not a new arrival). The scaling controller's arrival rate is
    its change over time (gateway/scaling/policy.py). One object per model, shared by the
    model's sites (SiteRegistry links them), so a site leaving takes nothing away."""

    requests: int = 0
    prompt_tokens: int = 0
    answer_tokens: int = 0

    def add(self, prompt_tokens: int, answer_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.answer_tokens += answer_tokens


@dataclass(slots=True)
class PeerMedians:
    """What a site that never measured its own step time (prefill rate) reads its same-model
    peers' median from (SiteState.step, prefill_tokens_per_s): each median kept with the
    generation of the peers' observations it was taken over, taken again only when one of
    them learned from a report, not at every routing decision (which read it for every such
    site: O(sites^2) a decision). One object per model, shared by the model's sites
    (SiteRegistry links them)."""

    step_generation: int = 0
    prefill_generation: int = 0
    _step: StepTime | None = None
    _step_at: int = -1
    _prefill: float | None = None
    _prefill_at: int = -1

    def changed(self) -> None:
        """The peers changed (one joined or left): both medians are taken again."""
        self.step_generation += 1
        self.prefill_generation += 1

    def step(self, site: SiteState) -> StepTime | None:
        """The median of `site`'s and its peers' fitted step times (None: none fitted)."""
        if self._step_at != self.step_generation:
            self._step = median_step(s.step_time.fit() for s in (site, *site.peers))
            self._step_at = self.step_generation
        return self._step

    def prefill_tokens_per_s(self, site: SiteState) -> float | None:
        """The median of `site`'s and its peers' measured prefill rates (None: none measured)."""
        if self._prefill_at != self.prefill_generation:
            sites = (site, *site.peers)
            rates = [rate for s in sites if (rate := s.prefill_rate.value) is not None]
            self._prefill = median_low(rates) if rates else None
            self._prefill_at = self.prefill_generation
        return self._prefill


@dataclass(slots=True)
class SiteState:
    config: SiteConfig
    site_id: int
    client: SiteClient
    healthy: bool = False
    info: SiteInfoView | None = None
    last_error: str | None = None
    checked_at: float = 0.0
    # Health checks in a row that got no answer (gateway/sites/health.py): a healthy site goes
    # down only after GATEWAY_HEALTH_FAILURES_TO_DOWN of them.
    unanswered_checks: int = 0
    # Requests this gateway has sent to the site that have not finished yet, and their token
    # load as this gateway sees it: prompt + planned answer tokens, less what has streamed back.
    # Changed only through requests' leases (gateway/sites/lease.py).
    in_flight: int = 0
    ledger_tokens: int = 0
    # Requests placed here since start (lease moves onto it), and that count as of the load
    # report before the last: requests placed before that report arrived are surely in the
    # last one (reports come every GATEWAY_LOAD_REPORT_INTERVAL_MS, more than a round trip).
    placed: int = 0
    placed_seen: int = field(default=0, compare=False)
    _placed_at_report: int = field(default=0, compare=False, repr=False)
    # Requests of this gateway that left the site since start (ended, or moved elsewhere), and
    # that count as of the report before the last: the same window as `placed`.
    left: int = 0
    left_seen: int = field(default=0, compare=False)
    _left_at_report: int = field(default=0, compare=False, repr=False)
    # The site's last pushed load report, and when it came (monotonic seconds).
    report: LoadView | None = None
    report_at: float = 0.0
    # Set by an operator's drain (gateway/admin/drain.py): the site takes nothing new.
    draining: bool = False
    # Latency-aware routing: round trips of the health checks, step times and prefill rates of
    # the load reports.
    rtt: RttEstimator = field(default_factory=RttEstimator)
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    prefill_rate: RateEstimate = field(default_factory=RateEstimate)
    # The other sites serving the same model (set by SiteRegistry): a site that has not reported
    # decoding (prefilling) yet is assumed to step (prefill) as the median of those that have.
    # Against a fixed prior, a site that had just served (and so was measured) lost to one that
    # never had whenever the prior was the faster: the next turn of a conversation left the
    # site holding its prefix. Left out of == and repr: peers name each other.
    peers: tuple[SiteState, ...] = field(default=(), compare=False, repr=False)
    # What the gateway knows of the site's prefix cache (its cache events, else its history).
    prefix: SitePrefix = field(default_factory=lambda: SitePrefix(DEFAULT_PREFIX_INDEX_BLOCKS))
    # Who put the site here: "federation" (the federation file), "operator" (the admin API) or
    # an actuator's name ("local", "kubernetes"): the scaling controller takes away only the
    # sites its actuator started (gateway/scaling/).
    origin: str = "federation"
    # When it joined (monotonic seconds; 0.0: at the start).
    joined_at: float = 0.0
    # Where its LoRA adapters are (its load reports, and what was routed there since).
    adapter_residency: SiteAdapters = field(default_factory=SiteAdapters, compare=False)
    # Its model's admitted work (shared with its same-model peers; set by SiteRegistry).
    arrivals: Arrivals = field(default_factory=Arrivals, compare=False, repr=False)
    # Its model's sites' medians (shared with its same-model peers; set by SiteRegistry).
    peer_medians: PeerMedians = field(default_factory=PeerMedians, compare=False, repr=False)
    # What report_at and checked_at are read from: the monotonic clock, or a simulation's
    # virtual one (fedsim/), which runs this same state on simulated time.
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    # Adapter changes this gateway made there (counted): a health check whose info was asked for
    # before one answered keeps the list that answer gave. It took the old list, and a model just
    # loaded (a fine-tuned one after its job succeeded) was gone from /v1/models until the next
    # check (CI, issue 72).
    adapter_changes: int = field(default=0, compare=False)
    _latency: tuple[tuple[object, ...], SiteLatency] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    @property
    def outstanding_tokens(self) -> int:
        """Token load: the larger of the site's own last report (all its work, a little late)
        and this gateway's ledger (its own requests, up to date)."""
        reported = self.report.token_load if self.report is not None else 0
        return max(self.ledger_tokens, reported)

    @property
    def unreported(self) -> int:
        """How many more requests the site holds than its last report may count: those placed
        here since the report before the last (at most those still in flight), less this
        gateway's requests that left it in the same window. Placements alone counted a site
        whose slots turn over every report as holding two report intervals' placements on top
        of a full batch: 1,024 streams on 1,024 slots at 330 answers a second looked 300 deep
        in queue, and 3-8 % of them were refused `queue_bound` (issue 74). Negative when more
        left than came: the site is emptying."""
        return min(self.in_flight, self.placed - self.placed_seen) - (self.left - self.left_seen)

    @property
    def requests_at_site(self) -> int:
        """Requests the site holds (running and waiting): its last report plus what this gateway
        placed since; before any report, this gateway's requests in flight. Not this gateway's
        in-flight count once the site reports: a request whose engine work is done stays in
        flight here while its last tokens travel, and a gateway that reads more slowly than the
        engine finishes requests saw a full site that had free slots (issue 74)."""
        report = self.report
        if report is None:
            return self.in_flight
        return max(0, report.running_requests + report.queued_requests + self.unreported)

    @property
    def queued_requests(self) -> int:
        """Waiting at the site: its last report, or more when the requests it holds (with those
        placed since the report) pass its batch slots (reports lag; a burst must still see a
        queue)."""
        reported = self.report.queued_requests if self.report is not None else 0
        slots = self.info.max_num_seqs if self.info is not None else None
        beyond = self.requests_at_site - slots if slots is not None else 0
        return max(reported, beyond)

    @property
    def queued_tokens(self) -> int:
        return self.report.queued_prompt_tokens if self.report is not None else 0

    def apply_report(self, report: LoadView) -> None:
        self.report, self.report_at = report, self.clock()
        self.placed_seen, self._placed_at_report = self._placed_at_report, self.placed
        self.left_seen, self._left_at_report = self._left_at_report, self.left
        steps, prefills = self.step_time.observations, self.prefill_rate.observations
        self.step_time.observe(report.running_requests, report.decode_tokens_per_s)
        self.prefill_rate.observe(report.prefill_tokens_per_s)
        if self.step_time.observations != steps:
            self.peer_medians.step_generation += 1
        if self.prefill_rate.observations != prefills:
            self.peer_medians.prefill_generation += 1
        self.adapter_residency.apply(
            report.adapters_on_device, report.adapters_in_host, report.adapter_load_s
        )

    @property
    def step(self) -> StepTime | None:
        """Its fitted step time, else its same-model peers' median (None: nobody measured)."""
        return self.step_time.fit() or self.peer_medians.step(self)

    @property
    def latency(self) -> SiteLatency:
        """Its latency signals, built again only when what they are made of changed (routing
        reads them for every site, several times a decision)."""
        report, rtt, own = self.report, self.rtt.value, self.step_time.fit()
        # The peers' median counts only for a site that has not measured its own.
        medians = self.peer_medians
        peers = -1 if own is not None else medians.step_generation
        inputs = (report, self.in_flight, self.step_time.observations, peers, rtt, self.info)
        cached = self._latency
        if cached is not None and cached[0] == inputs:
            return cached[1]
        reported = report.running_requests + report.queued_requests if report else 0
        latency = SiteLatency(
            rtt_s=rtt,
            step=own or medians.step(self),
            batch_slots=self.info.max_num_seqs if self.info is not None else None,
            requests=max(reported, self.in_flight),
            remaining_answer_tokens=report.predicted_remaining_tokens if report else 0,
        )
        self._latency = (inputs, latency)
        return latency

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def capacity_weight(self) -> float:
        return self.config.capacity_weight

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The federation file's figure (the operator's word), else the site's measured rate,
        else its measured same-model peers' median; None when nobody has measured one."""
        if self.config.prefill_tokens_per_s is not None:
            return self.config.prefill_tokens_per_s
        if (measured := self.prefill_rate.value) is not None:
            return measured
        return self.peer_medians.prefill_tokens_per_s(self)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """None when unknown: no info yet, or an engine that does not say (0 blocks)."""
        info = self.info
        if info is None or info.kv_blocks_total == 0:
            return None
        return info.kv_blocks_total * info.kv_block_size

    @property
    def adapters(self) -> frozenset[str]:
        """The adapters the site said it serves at its last health check."""
        return frozenset(self.info.adapters) if self.info is not None else frozenset()

    @property
    def can_release_queued(self) -> bool:
        return self.client.can_release_queued

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def max_model_len(self) -> int | None:
        return self.info.max_model_len if self.info is not None else None

    def take_adapters(self, served: tuple[str, ...]) -> None:
        """The site's adapter list as its answer to a load or unload gives it, for the catalogue
        at once (the next health check would find the same)."""
        self.adapter_changes += 1
        if self.info is not None:
            self.info = replace(self.info, adapters=served)

    def mark_healthy(self, info: SiteInfoView, adapter_changes: int | None = None) -> None:
        """`adapter_changes`: the count when `info` was asked for (None: now); if a change came
        since, its adapter list stays."""
        changed = adapter_changes is not None and adapter_changes != self.adapter_changes
        if changed and self.info is not None:
            info = replace(info, adapters=self.info.adapters)
        self.healthy, self.info, self.last_error = True, info, None
        self.unanswered_checks = 0
        self.checked_at = self.clock()
        self.prefix.history.set_capacity_tokens(self.kv_capacity_tokens)

    def mark_unhealthy(self, reason: str) -> None:
        self.healthy, self.last_error = False, reason
        self.checked_at = self.clock()


def median_step(steps: Iterable[StepTime | None]) -> StepTime | None:
    """The measured step line whose one-sequence step is the median (the lower of the two
    middle ones); None when none is measured."""
    measured = sorted((s for s in steps if s is not None), key=lambda s: s.at(1))
    return measured[(len(measured) - 1) // 2] if measured else None


class SiteRegistry:
    """The sites routing chooses from. The federation file's sites are here from the start;
    sites join and leave at run time through gateway/admin/membership.py (operators' admin API,
    the scaling controller's actuators), which also starts and stops what watches them."""

    def __init__(self, sites: Iterable[SiteState]) -> None:
        self._sites = {site.name: site for site in sites}
        self._arrivals: dict[str, Arrivals] = {}
        self._peer_medians: dict[str, PeerMedians] = {}
        self._link_peers()

    def _link_peers(self) -> None:
        for medians in self._peer_medians.values():
            medians.changed()
        for site in self._sites.values():
            site.arrivals = self._arrivals.setdefault(site.config.model, Arrivals())
            site.peer_medians = self._peer_medians.setdefault(site.config.model, PeerMedians())
            site.peers = tuple(
                other
                for other in self._sites.values()
                if other is not site and other.config.model == site.config.model
            )

    def add(self, site: SiteState) -> None:
        """A site joins: routable from the next decision on (once healthy). A taken name is a
        ValueError (the caller checks first; this is the last guard)."""
        if site.name in self._sites:
            raise ValueError(f"a site named {site.name!r} is already registered")
        self._sites[site.name] = site
        self._link_peers()

    def remove(self, name: str) -> SiteState | None:
        """The site leaves routing (its client is the caller's to close); None if unknown."""
        site = self._sites.pop(name, None)
        if site is not None:
            site.peers = ()
            site.peer_medians = PeerMedians()
            self._link_peers()
        return site

    def all(self) -> list[SiteState]:
        return list(self._sites.values())

    def get(self, name: str) -> SiteState | None:
        return self._sites.get(name)

    def arrivals(self, model: str) -> Arrivals:
        """The model's admitted work so far (zero for a model no site has served yet)."""
        return self._arrivals.setdefault(model, Arrivals())

    def max_model_len(self, model: str) -> int | None:
        """The smallest context among healthy sites serving the model (what every site can hold)."""
        lengths = [
            s.info.max_model_len
            for s in self._sites.values()
            if s.healthy and s.info is not None and s.config.model == model
        ]
        return min(lengths) if lengths else None

    def embedding_dimension(self, model: str) -> int | None:
        """The length of the model's vectors as its healthy sites say it (None: none says, or
        they disagree, and each site decides what it can give)."""
        said = {
            s.info.embedding_dimension
            for s in self._sites.values()
            if s.healthy and s.info is not None and s.config.model == model
            and s.info.embedding_dimension > 0
        }  # fmt: skip
        return said.pop() if len(said) == 1 else None

    def served_adapters(self) -> dict[str, str]:
        """Each adapter a healthy site serves, with its base model (the site's). An adapter
        named as a model is left out: the name means the model."""
        served: dict[str, str] = {}
        models = {s.config.model for s in self._sites.values()}
        for site in self._sites.values():
            if site.healthy:
                for adapter in site.adapters - models:
                    served.setdefault(adapter, site.config.model)
        return served

    def serves_adapter(self, model: str, adapter: str) -> bool:
        """Whether a healthy site of `model` lists `adapter`."""
        return any(
            s.healthy and s.config.model == model and adapter in s.adapters
            for s in self._sites.values()
        )

    async def close(self) -> None:
        for site in self._sites.values():
            await site.client.close()
