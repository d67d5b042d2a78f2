"""Site filters. Each keeps the order of its input and never adds a site."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.load import fits, free_kv_tokens
from gateway.routing.types import RoutingRequest, S


@dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Contract: keeps exactly the sites currently marked healthy."""

    name: str = "healthy"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        return [site for site in sites if site.healthy]


@dataclass(frozen=True, slots=True)
class ServesModelFilter:
    """Contract: keeps exactly the sites configured for the request's model and, for a request
    of a LoRA adapter, listing that adapter (every profile starts with this filter, so no
    profile can send an adapter's request to a site that would refuse it)."""

    name: str = "serves_model"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        adapter = request.adapter
        return [
            site
            for site in sites
            if site.model == request.model and (adapter is None or adapter in site.adapters)
        ]


@dataclass(frozen=True, slots=True)
class FitsContextFilter:
    """Contract: keeps the sites whose context holds prompt + max_tokens; a site whose context is
    not known yet is kept (the site itself rejects what it cannot hold)."""

    name: str = "fits_context"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        need = request.prompt_tokens + request.max_tokens
        return [s for s in sites if s.max_model_len is None or need <= s.max_model_len]


@dataclass(frozen=True, slots=True)
class KvBoundFilter:
    """Contract: keeps the sites whose free KV (kv_capacity_tokens - outstanding_tokens) holds the
    request's prompt + planned answer (the prediction capped at max_tokens, or max_tokens without
    one). When none holds it now, keeps the sites whose whole KV capacity could: the request
    waits in the queue of one of them (refusing work that only has to wait would turn every
    burst into 503s). A site whose KV capacity is not known yet is kept."""

    name: str = "kv_bound"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        need = request.total_tokens
        now = [s for s in sites if fits(need, free_kv_tokens(s))]
        return now or [s for s in sites if fits(need, s.kv_capacity_tokens)]


@dataclass(frozen=True, slots=True)
class NotDrainingFilter:
    """Contract: keeps exactly the sites that are not being drained."""

    name: str = "not_draining"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        return [site for site in sites if not site.draining]


@dataclass(frozen=True, slots=True)
class QueueBoundFilter:
    """Contract: keeps the sites whose waiting queue is below both bounds (queued requests
    < max_requests and queued prompt tokens < max_tokens); a bound of None is no bound.

    Why: a site with a long queue would make the request wait without limit; refusing it here
    turns overload into a prompt 503 with Retry-After instead."""

    max_requests: int | None = None
    max_tokens: int | None = None
    name: str = "queue_bound"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        return [
            s
            for s in sites
            if (self.max_requests is None or s.queued_requests < self.max_requests)
            and (self.max_tokens is None or s.queued_tokens < self.max_tokens)
        ]


@dataclass(frozen=True, slots=True)
class SlotRoomFilter:
    """Contract: keeps the sites with a free batch slot (not SiteLatency.full: requests there,
    running + queued, below its max_num_seqs) when any candidate has one, else every candidate;
    a site whose batch slots are unknown counts as having room.

    Why: a request sent to a full site waits for one of its answers to end, and answers are
    long-tailed: at a 16-slot site holding 1,024-token answers that was 2-5 s to a first token
    (the H100 federation bench, ShareGPT), while a larger site still had free slots. The cost
    model's queue term is right on average, but a site's slots free up in a few long waits,
    and the TTFT SLO is a p99. Recomputing a cached prefix elsewhere costs a prefill (tens of
    milliseconds for a 4k-token prompt on a GPU); waiting for a slot costs answers' lengths."""

    name: str = "slot_room"

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]:
        free = [s for s in sites if not s.latency.full]
        return free or list(sites)
