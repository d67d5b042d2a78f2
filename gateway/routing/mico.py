"""MICO token-balanced assignment: the batch form (`mico_assign`); the online form is the routing
profile `mico` (gateway/routing/catalogue.py).

Both balance token load, not request count: a query weighs prompt + predicted answer tokens, a
site's load is its token sum divided by its capacity weight, and a query is only placed where
it fits the site's free KV (capacity - outstanding tokens - what this batch already put there).

Batch form, for a batch known up front (the offline batch API):
1. Order: queries are grouped by predicted bucket; groups are handed out longest bucket first,
   and inside a group longer queries go first. Placing long queries early leaves the short
   ones to even out what is left, as in longest-processing-time scheduling.
2. Each site keeps a running token sum, starting from its current outstanding tokens.
3. A group is shared by water-filling: the level L is chosen so that raising every site below
   it to L * capacity_weight tokens absorbs exactly the group's tokens; a site's target is
   max(0, L * weight - running sum). Targets are proportional to capacity, so a site of weight 2
   gets twice the tokens of a site of weight 1 once loads are even, and a site already ahead
   gets less (or nothing). With k equal sites, equal loads and g equal queries this is
   floor(g / k) queries each. Sites whose free KV cannot hold even the group's shortest query
   take no part.
4. Borrowing: the queries of a group that fit no site's remaining target (the remainder of a
   group that does not split evenly) are borrowed into the next, shorter group: they count in
   its water-filling level and are placed first, longest first, each on the site with the
   smallest normalized load after placement where it fits the free KV, whatever the targets
   say. Equal sites take turns (least recently served first, then by name), so borrowed
   queries go round robin over sites that are level. Placing them in the next group rather
   than carrying them on keeps a long query from landing last, on top of an even batch.
5. The group's own queries are dealt in turns: sites whose target still holds the group's
   shortest query, lightest first (ties to the least recently served, then by name); each
   query goes to the next site in turn whose remaining target holds it whole and whose free
   KV fits it. A query that fits no site's free KV is reported unassigned at once (free KV only
   shrinks during a batch).
6. What the last group must borrow has no next group: it is placed as in step 4; a query that
   fits nowhere gets site None and a reason.

Cost: one sort for the grouping and ordering, O(k log k) water-filling per group (k sites), then
one turn scan per query: linear in the number of queries for a fixed number of sites.

Online form, for queries arriving one at a time: place the query on the site with the smallest
capacity-normalized token load after placement, (outstanding + query tokens) / weight, among the
sites where it fits the free KV (all of them when none does now: it waits in a queue; the
`kv_bound` filter). Ties take turns (round robin in name order) with one turn counter per
(model, bucket), so equal sites alternate within each bucket just as borrowed queries go round
robin in the batch form. Without a batch there is nothing to group or borrow: the online form is
the batch form's step 4 applied to each arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.routing.load import fits, free_kv_tokens, is_tie, normalized
from gateway.routing.types import RoutableSite

# Float slack when a query is compared with a water-filling target computed by division.
_TARGET_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class BatchQuery:
    """One query of a batch. predicted_tokens is the planned answer length (the prediction
    capped at max_tokens, or max_tokens without one); bucket is the predictor's length bucket."""

    id: str
    prompt_tokens: int
    predicted_tokens: int
    bucket: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.predicted_tokens


@dataclass(frozen=True, slots=True)
class BatchSite:
    """A site as the batch form sees it; kv_free_tokens None means the KV bound is unknown."""

    name: str
    capacity_weight: float
    outstanding_tokens: int = 0
    kv_free_tokens: int | None = None

    @classmethod
    def of(cls, site: RoutableSite) -> BatchSite:
        free = free_kv_tokens(site)
        return cls(site.name, site.capacity_weight, site.outstanding_tokens, free)


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where a query went. tokens_after is the site's running token sum right after this
    placement (outstanding + this batch so far), load_after the same divided by the capacity
    weight; both None, like site, when the query fits nowhere. why explains the placement."""

    query_id: str
    site: str | None
    tokens_after: int | None
    load_after: float | None
    why: str


@dataclass(slots=True)
class _Site:
    name: str
    weight: float
    tokens: int
    kv_room: int | None
    # Sequence number of the last placement here; equal sites then take turns.
    served: int = -1

    @property
    def load(self) -> float:
        return self.tokens / self.weight

    def takes(self, query: BatchQuery) -> bool:
        return fits(query.tokens, self.kv_room)


@dataclass(slots=True)
class _Batch:
    sites: list[_Site]
    results: dict[str, Assignment] = field(default_factory=dict)
    placed: int = 0

    def place(self, query: BatchQuery, site: _Site, why: str) -> None:
        site.tokens += query.tokens
        if site.kv_room is not None:
            site.kv_room -= query.tokens
        site.served, self.placed = self.placed, self.placed + 1
        self.results[query.id] = Assignment(query.id, site.name, site.tokens, site.load, why)

    def reject(self, query: BatchQuery) -> None:
        most = max((s.kv_room for s in self.sites if s.kv_room is not None), default=0)
        why = f"fits no site's free KV: needs {query.tokens} tokens, most free {most}"
        self.results[query.id] = Assignment(query.id, None, None, None, why)

    def fits_somewhere(self, query: BatchQuery) -> bool:
        return any(site.takes(query) for site in self.sites)

    def place_lightest(self, query: BatchQuery, why: str) -> _Site | None:
        """Places the query where the load after placement is smallest, equal sites taking
        turns (least recently served first, then by name); None when it fits nowhere."""
        candidates = [site for site in self.sites if site.takes(query)]
        if not candidates:
            self.reject(query)
            return None
        after = {site.name: (site.tokens + query.tokens) / site.weight for site in candidates}
        best = min(after.values())
        ties = [site for site in candidates if is_tie(after[site.name], best)]
        site = min(ties, key=lambda site: (site.served, site.name))
        self.place(query, site, why)
        return site


def mico_assign(queries: Sequence[BatchQuery], sites: Sequence[BatchSite]) -> list[Assignment]:
    """Contract: returns exactly one Assignment per query, in the order of `queries`, following
    the batch rule in the module docstring; never places more on a site than its free KV holds;
    pure and deterministic (same inputs, same output). Raises ValueError on duplicate query ids
    or site names, negative token counts, or a capacity weight <= 0."""
    _validate(queries, sites)
    if not sites:
        return [Assignment(q.id, None, None, None, "no site to assign to") for q in queries]
    batch = _Batch(
        [_Site(s.name, s.capacity_weight, s.outstanding_tokens, s.kv_free_tokens) for s in sites]
    )
    borrowed: list[BatchQuery] = []
    for bucket, group in _groups_longest_first(queries):
        borrowed = _deal_group(batch, bucket, borrowed, group)
    for query in borrowed:  # already longest first
        batch.place_lightest(query, f"left over from bucket {query.bucket}: least loaded after")
    return [batch.results[q.id] for q in queries]


def _validate(queries: Sequence[BatchQuery], sites: Sequence[BatchSite]) -> None:
    if len({q.id for q in queries}) != len(queries):
        raise ValueError("query ids must be unique within a batch")
    if len({s.name for s in sites}) != len(sites):
        raise ValueError("site names must be unique")
    for site in sites:
        normalized(0, site.capacity_weight)  # raises on a weight <= 0
    if any(q.prompt_tokens < 0 or q.predicted_tokens < 0 for q in queries):
        raise ValueError("token counts must be >= 0")


def _groups_longest_first(queries: Iterable[BatchQuery]) -> list[tuple[int, list[BatchQuery]]]:
    groups: dict[int, list[BatchQuery]] = {}
    for query in sorted(queries, key=lambda q: -q.tokens):  # stable: ties keep input order
        groups.setdefault(query.bucket, []).append(query)
    return sorted(groups.items(), key=lambda item: -item[0])


def _water_fill(sites: Sequence[_Site], total: int) -> tuple[float, dict[str, float]]:
    """The level L (tokens per unit of weight) at which raising every site below it to L absorbs
    `total` tokens, and each site's target max(0, L * weight - tokens)."""
    order = sorted(sites, key=lambda site: site.load)
    tokens = weight = 0.0
    level = 0.0
    for i, site in enumerate(order):
        tokens, weight = tokens + site.tokens, weight + site.weight
        level = (total + tokens) / weight
        if i + 1 == len(order) or level <= order[i + 1].load:
            break
    return level, {site.name: max(0.0, level * site.weight - site.tokens) for site in sites}


def _deal_group(
    batch: _Batch, bucket: int, borrowed: list[BatchQuery], own: list[BatchQuery]
) -> list[BatchQuery]:
    """Deals one group, with what the previous group borrowed into it, toward the
    water-filling level; returns what this group must borrow into the next one."""
    shortest = own[-1].tokens  # own is longest first
    eligible = [site for site in batch.sites if fits(shortest, site.kv_room)]
    total = sum(q.tokens for q in borrowed) + sum(q.tokens for q in own)
    level, room = _water_fill(eligible, total)
    for query in borrowed:
        # Placed whatever the targets say: carried on and on, a long query would land last, on
        # top of an already even batch.
        site = batch.place_lightest(query, f"bucket {bucket}: borrowed from bucket {query.bucket}")
        if site is not None and site.name in room:
            room[site.name] -= query.tokens
    turns = _Turns(
        sorted(
            (site for site in eligible if _holds(room[site.name], shortest)),
            key=lambda site: (site.load, site.served, site.name),
        )
    )
    to_borrow: list[BatchQuery] = []
    for query in own:
        site = turns.next(_within(room, query))
        if site is None:
            if batch.fits_somewhere(query):
                to_borrow.append(query)
            else:
                batch.reject(query)
            continue
        batch.place(query, site, f"bucket {bucket}: turn toward level {level:.1f}")
        room[site.name] -= query.tokens
        if not (_holds(room[site.name], shortest) and fits(shortest, site.kv_room)):
            turns.drop(site)  # it cannot take even the group's shortest query any more
    return to_borrow


@dataclass(slots=True)
class _Turns:
    """Sites taking turns in a fixed order; a turn passes over sites that decline."""

    sites: list[_Site]
    at: int = 0

    def next(self, accepts: Callable[[_Site], bool]) -> _Site | None:
        for step in range(len(self.sites)):
            index = (self.at + step) % len(self.sites)
            if accepts(self.sites[index]):
                self.at = index + 1
                return self.sites[index]
        return None

    def drop(self, site: _Site) -> None:
        index = self.sites.index(site)
        del self.sites[index]
        if index < self.at:
            self.at -= 1


def _within(room: dict[str, float], query: BatchQuery) -> Callable[[_Site], bool]:
    def accepts(site: _Site) -> bool:
        return _holds(room[site.name], query.tokens) and site.takes(query)

    return accepts


def _holds(room: float, tokens: int) -> bool:
    return tokens <= room * (1 + _TARGET_SLACK) + _TARGET_SLACK
