"""The federation's cost model: a request's estimated completion time on each site, with what the
site already caches, its wide-area round trip, its queue and its speed, and the predicted answer.

For a request with prompt P and planned answer A (the predictor's, capped at max_tokens) on a
site with measured round trip rtt, prefill rate F (prompt tokens per second: the federation
file's per-site figure, else the rate its load reports measure, else its same-model peers',
else the profile's) and step time t(b) at batch b (fitted to its load reports,
gateway/routing/latency.py), S batch slots and n requests present:

    cached    = the longest run of P's blocks the site holds (its prefix index), at most P - 1:
                the last prompt token is always computed; of it, `host` tokens are in host memory
    uncached  = P - cached
    queue     = queued prompt tokens / F                    (prefills ahead of it)
              + (n + 1 - S) * R * t(S) / S  when n >= S      (a slot to free: R the mean answer
                                                              left of the requests there)
    prefill   = (uncached + host * host_ratio) / F           (host blocks come back over PCIe:
                                                              host_ratio of a computed token)
    decode    = (A - 1) * t(min(S, n + 1))
    adapter   = 0 for the base model or an adapter in a device slot there; host_s for one in
                host memory only; the site's measured read time (else load_s) for one on disk
                (gateway/routing/adapter_residency.py): only its own request waits for the load
    ECT       = rtt + queue + adapter + prefill + decode

A request also slows the ones already running there (r = min(n, S) of them, R answer tokens
left on average), and the router owns that cost too: greedy ECT alone sends work to the fastest
site until every request on it runs slower, each new one blind to what it does to the others:

    others    = r * prefill                      (its prefill stalls their decoding: chunked
                                                   prefill runs inside their steps)
              + r * min(A - 1, R) * (t(min(S, n + 1)) - t(r))
                                                 (a batch one larger while both decode;
                                                   nothing when it waits for a slot)
    cost      = ECT + others_weight * others

The lowest cost wins (`completion_cost` scorer, ratio-normalized: a site twice as slow scores
half); others_weight 1 minimizes the total time the federation's requests spend (their own and
what each adds to the others'), 0 is the request's own ECT.

Its KV bound is the `kv_room` filter (the blocks it shares with what the site caches on
the device are resident already, so need = P + A - cached on device) and the `hot_spot_guard`
filter keeps a site out while its queue is far above the least loaded one's (a shared first
block would otherwise draw every request to one site: every cache-aware router carries such a
guard). MICO's token balance is the special case of no reuse and equal rates; least_latency's
model is this one without prefill rate and reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.adapter_residency import AdapterTier
from gateway.routing.latency import LatencyModel
from gateway.routing.load import fits, free_kv_tokens
from gateway.routing.types import PrefixMatch, RoutableSite, RoutingRequest, S, StepTime

# A site whose prefill rate nobody configured is assumed this fast (prompt tokens / s).
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
# A token brought back from host memory costs this share of computing it (a 512-token block of
# a 1B model: ~0.3 ms over PCIe 5 against 3-5 ms of prefill; issue 33).
DEFAULT_HOST_RATIO = 0.1
# The delay a request adds to the requests already at a site counts as much as its own.
DEFAULT_OTHERS_WEIGHT = 1.0
# A LoRA adapter read from disk at a site that has not measured its reads yet (its files read
# and checked: the CPU sites' rank-8 adapters take ~0.05 s, a rank-16 Llama-8B one ~0.5 s).
DEFAULT_ADAPTER_LOAD_S = 0.5
# An adapter copied from host memory into a device slot (a rank-16 8B adapter is ~60 MB:
# milliseconds over PCIe).
DEFAULT_ADAPTER_HOST_S = 0.005


@dataclass(frozen=True, slots=True)
class Estimate:
    """One site's estimate for one request (seconds; tokens)."""

    rtt_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    cached_tokens: int
    device_tokens: int
    others_s: float = 0.0  # the delay it adds to the site's running requests, weighted
    adapter_s: float = 0.0  # its LoRA adapter brought into a device slot first

    @property
    def completion_s(self) -> float:
        return self.rtt_s + self.queue_s + self.adapter_s + self.prefill_s + self.decode_s

    @property
    def cost_s(self) -> float:
        return self.completion_s + self.others_s


@dataclass(frozen=True, slots=True)
class CompletionCostModel:
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    host_ratio: float = DEFAULT_HOST_RATIO
    prior_step: StepTime = LatencyModel().prior_step
    others_weight: float = DEFAULT_OTHERS_WEIGHT
    adapter_load_s: float = DEFAULT_ADAPTER_LOAD_S
    adapter_host_s: float = DEFAULT_ADAPTER_HOST_S
    # True: no adapter term (GATEWAY_ADAPTER_ROUTING=blind: every site alike for an adapter).
    adapter_blind: bool = False

    def adapter_s(self, request: RoutingRequest, site: RoutableSite) -> float:
        """Contract: the module docstring's adapter term: seconds before the request's adapter
        sits in a device slot at the site (0.0 for the base model or one already there)."""
        if request.adapter is None or self.adapter_blind:
            return 0.0
        residency = site.adapter_residency
        tier = residency.tier(request.adapter)
        if tier is AdapterTier.DEVICE:
            return 0.0
        if tier is AdapterTier.HOST:
            return self.adapter_host_s
        return (residency.load_s or self.adapter_load_s) + self.adapter_host_s

    def prefill_rate(self, site: RoutableSite) -> float:
        return site.prefill_tokens_per_s or self.prefill_tokens_per_s

    def queue_s(self, site: RoutableSite) -> float:
        """Contract: the module docstring's queue term: the site's work ahead of a new request,
        in seconds (it does not depend on the request)."""
        latency = site.latency
        step = latency.step or self.prior_step
        wait = site.queued_tokens / self.prefill_rate(site)
        slots, present = latency.batch_slots, latency.requests
        if latency.full and slots is not None:
            mean_left = latency.remaining_answer_tokens / present
            wait += (present + 1 - slots) * mean_left * step.at(slots) / slots
        return wait

    def estimate(
        self, request: RoutingRequest, site: RoutableSite, match: PrefixMatch | None = None
    ) -> Estimate:
        """Contract: the module docstring's ECT terms for `request` on `site`; `match` is what
        the site caches of the prompt (read from site.prefix when not given)."""
        match = site.prefix.match(request) if match is None else match
        latency = site.latency
        step = latency.step or self.prior_step
        cached = max(0, min(match.cached_tokens, request.prompt_tokens - 1))
        device = min(match.device_tokens, cached)
        uncached = request.prompt_tokens - cached
        rate = self.prefill_rate(site)
        prefill = (uncached + (cached - device) * self.host_ratio) / rate
        slots, present = latency.batch_slots, max(latency.requests, 0)
        joins = present + 1 if slots is None else min(slots, present + 1)
        answer = max(request.answer_tokens - 1, 0)
        decode = answer * step.at(joins)
        others = 0.0
        running = present if slots is None else min(slots, present)
        if self.others_weight and running:
            mean_left = latency.remaining_answer_tokens / present
            slower = step.at(joins) - step.at(running)  # 0 when it waits for a slot
            others = running * (prefill + min(answer, mean_left) * slower) * self.others_weight
        rtt = latency.rtt_s or 0.0
        adapter = self.adapter_s(request, site)
        return Estimate(
            rtt, self.queue_s(site), prefill, decode, cached, device, others, adapter
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CompletionCost:
    """Contract: the request's estimated completion time on the site plus the weighted delay it
    adds to the site's running requests (Estimate.cost_s), seconds (> 0 whenever the site steps
    in > 0 s); lower is better."""

    model: CompletionCostModel = CompletionCostModel()
    name: str = "completion_cost"
    reads_prefix: bool = True
    reads_adapters: bool = True

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float:
        return self.model.estimate(request, site).cost_s


@dataclass(frozen=True, slots=True)
class KvRoomFilter:
    """Contract: keeps the sites whose free KV holds the request's prompt + planned answer less
    what it shares with blocks the site holds on the device (they are resident already); when
    none does now, the sites whose whole KV capacity could (it waits in a queue there), as
    KvBoundFilter does. A site whose capacity is unknown is kept."""

    name: str = "kv_room"
    reads_prefix: bool = True

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        total = request.total_tokens

        def room(site: S, free: int | None) -> bool:
            # The prefix is looked up only where the whole request would not fit: what it
            # shares can only lower the need (most sites hold none of it; a lookup per site per
            # decision was most of this filter's cost).
            return fits(total, free) or fits(total - site.prefix.match(request).device_tokens, free)

        now = [s for s in sites if room(s, free_kv_tokens(s))]
        if now:
            return now
        return [s for s in sites if room(s, s.kv_capacity_tokens)]


@dataclass(frozen=True, slots=True)
class HotSpotGuard:
    """Contract: leaves out every site whose queue (CompletionCostModel.queue_s, seconds of work
    ahead of a new request) is both more than `ratio` times and more than `margin_s` above the
    least queued candidate's; never leaves out the least queued one. SGLang's router switches to
    the least loaded worker on the same two-sided test (64 requests and 1.5x)."""

    model: CompletionCostModel = CompletionCostModel()
    ratio: float = 2.0
    margin_s: float = 1.0
    name: str = "hot_spot_guard"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        if len(sites) < 2:
            return list(sites)
        queues = [self.model.queue_s(site) for site in sites]
        least = min(queues)
        return [
            site
            for site, queue in zip(sites, queues, strict=True)
            if not (queue > self.ratio * least and queue - least > self.margin_s)
        ]
