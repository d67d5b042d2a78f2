"""Scorers and costs that read where prefixes are cached, besides the cost model: the peers'
rules, as profiles for comparison, and session affinity.

- `prefix_match` (pure prefix affinity): the longest cached prefix wins, whatever the load.
  Every request that shares a first block (a system prompt) goes to one site: the hot spot that
  every cache-aware router guards against (shown by the federation benchmark).
- `dynamo_cost` (NVIDIA Dynamo's KV router, docs/router/kv_cache_routing.md): cost =
  overlap_weight x blocks to prefill + active blocks, lowest wins. Dynamo tracks a worker's active
  blocks itself as it routes; here the gateway's own ledger of what it sent stands for them.
- `session_affinity`: 1 for the site that served the request's session last, else 0; with the
  completion-cost scorer at weight 1 and this one at w, a session stays on its site while that
  site's estimated completion is within 1 / (1 - w) of the best (the prefix-cache-affinity
  filter of the Gateway API Inference Extension keeps stickiness the same way: only while the
  predicted latency is not much worse).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.routing.types import RoutableSite, RoutingRequest, Scored


@dataclass(frozen=True, slots=True)
class PrefixMatchScorer:
    """Contract: each candidate's cached prefix of the prompt over the longest any candidate
    caches (1 for the longest; 0 for all when none caches any)."""

    name: str = "prefix_match"
    reads_prefix: bool = True

    def score(self, request: RoutingRequest, sites: Sequence[RoutableSite]) -> Scored:
        cached = [site.prefix.match(request).cached_tokens for site in sites]
        longest = max(cached, default=0)
        return Scored(tuple(c / longest if longest else 0.0 for c in cached))


@dataclass(frozen=True, slots=True)
class DynamoCost:
    """Contract: overlap_weight x (prompt - cached) / block_tokens + (ledger_tokens + prompt) /
    block_tokens: blocks to prefill, weighted, plus the blocks the site would hold, lower is
    better."""

    overlap_weight: float = 1.0
    block_tokens: int = 16
    name: str = "dynamo_cost"
    reads_prefix: bool = True

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float:
        cached = site.prefix.match(request).cached_tokens
        prefill = (request.prompt_tokens - cached) / self.block_tokens
        active = (site.ledger_tokens + request.prompt_tokens) / self.block_tokens
        return self.overlap_weight * prefill + active


@dataclass(slots=True)
class SessionAffinity:
    """Contract: 1.0 for the candidate that took the request's session last (by session key),
    0.0 for the others and for requests without one; remembers the last `max_sessions` sessions
    (least recently routed forgotten first)."""

    max_sessions: int = 100_000
    name: str = "session_affinity"
    _last: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def score(self, request: RoutingRequest, sites: Sequence[RoutableSite]) -> Scored:
        last = self._last.get(request.session_key) if request.session_key else None
        return Scored(tuple(1.0 if site.name == last else 0.0 for site in sites))

    def routed(self, request: RoutingRequest, site: RoutableSite) -> None:
        key = request.session_key
        if key is None:
            return
        self._last[key] = site.name
        self._last.move_to_end(key)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)


@dataclass(frozen=True, slots=True)
class RecordPrefix:
    """Tells the chosen site's prefix view what it was sent (what an index without cache events
    learns from); a profile whose parts read prefixes observes with it."""

    def routed(self, request: RoutingRequest, site: RoutableSite) -> None:
        site.prefix.routed(request)


def reads_prefix(part: object) -> bool:
    """A part (or the cost a scorer normalizes) that reads the sites' prefix views."""
    inner = getattr(part, "cost", None)
    return bool(getattr(part, "reads_prefix", False) or getattr(inner, "reads_prefix", False))
