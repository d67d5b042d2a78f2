"""What the gateway knows of one site's prefix cache, as routing reads it (a PrefixView).

Precise when the site streams cache events (our engines' load reports with cache events, or
vLLM's KV events when the federation file names their endpoint): the events feed a
SiteCacheIndex. Otherwise approximate: the RoutingHistory of what this gateway sent there.

Several gateway replicas: each subscribes to every site's events itself and builds its own index
from its own snapshot, so replicas agree up to what is in flight on their streams (one report
interval plus the network); a replica that missed a batch answers no match for that site until
its re-subscription's snapshot, while the others still match. The approximate index is per
replica and knows only that replica's traffic: with n replicas sharing traffic evenly it sees
about 1/n of what a site was sent.
"""

from __future__ import annotations

from fedllm_contract.cache_events import CacheEventBatch
from gateway.routing.prefix.history import HISTORY_BLOCK_TOKENS, RoutingHistory
from gateway.routing.prefix.site_index import ApplyOutcome, SiteCacheIndex
from gateway.routing.types import NO_MATCH, PrefixMatch, RoutingRequest

# Block ids kept per site by default (GATEWAY_PREFIX_INDEX_MAX_BLOCKS).
DEFAULT_PREFIX_INDEX_BLOCKS = 1 << 18


class SitePrefix:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.history = RoutingHistory(max_blocks)
        self.index: SiteCacheIndex | None = None
        # One decision asks a site's match for the same request from several parts (filters,
        # scorers): the last answer is kept until the request or what is known changes.
        self._changes = 0
        self._last: tuple[RoutingRequest, int, PrefixMatch] | None = None

    @property
    def mode(self) -> str:
        """ "events" (precise) or "history" (approximate)."""
        return "history" if self.index is None else "events"

    @property
    def blocks(self) -> int:
        """Block ids held in memory for this site (what /metrics exports)."""
        return len(self.history) if self.index is None else len(self.index)

    @property
    def stale(self) -> bool:
        return self.index is not None and self.index.stale

    def follow_events(self) -> SiteCacheIndex:
        """Switches to the precise index (stale until the first snapshot); the history is
        dropped: from now on the events are the truth."""
        if self.index is None:
            self.index = SiteCacheIndex(self.max_blocks)
            self.history = RoutingHistory(self.max_blocks)
            self._changes += 1
        return self.index

    def apply(self, batch: CacheEventBatch) -> ApplyOutcome:
        """A batch of the site's cache events (follow_events first); GAP: re-subscribe."""
        self._changes += 1
        return self.follow_events().apply(batch)

    def match(self, request: RoutingRequest) -> PrefixMatch:
        last = self._last
        if last is not None and last[0] is request and last[1] == self._changes:
            return last[2]
        found = self._match(request)
        self._last = (request, self._changes, found)
        return found

    def _match(self, request: RoutingRequest) -> PrefixMatch:
        if not request.prompt_token_ids:
            return NO_MATCH
        index = self.index
        if index is None:
            size = HISTORY_BLOCK_TOKENS
            cached = self.history.match(request.block_ids(size))
            return PrefixMatch(cached * size, cached * size) if cached else NO_MATCH
        block_size = index.block_size
        if block_size is None or index.stale:
            return NO_MATCH
        cached, device = index.match(request.block_ids(block_size))
        return PrefixMatch(cached * block_size, device * block_size) if cached else NO_MATCH

    def routed(self, request: RoutingRequest) -> None:
        if self.index is None and request.prompt_token_ids:
            self.history.record(request.block_ids(HISTORY_BLOCK_TOKENS))
            self._changes += 1
