"""The batch API's group-wise assignment by the cost model of online routing
(gateway/routing/completion_cost.py), for profiles that route by it.

MICO's order (gateway/routing/mico.py): length buckets longest first, longer queries first within
one; each query then goes to the site of the lowest cost (its completion time plus the delay it
adds to the requests already running there, as online) *given what this batch already put
there*: each placement adds its own work to its site (its prefill, and its share of
decode steps at a full batch), and its prompt's blocks count as cached there for the queries
after it (items sharing a prefix gather on one site, unless the added work outweighs it). Pure
and deterministic: ties go to the site placed on least recently, then by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.routing.completion_cost import CompletionCostModel
from gateway.routing.load import normalized
from gateway.routing.mico import Assignment
from gateway.routing.prefix.history import HISTORY_BLOCK_TOKENS
from gateway.routing.types import PrefixMatch, RoutableSite, RoutingRequest


@dataclass(frozen=True, slots=True)
class CostQuery:
    id: str
    request: RoutingRequest
    bucket: int


@dataclass(slots=True)
class _Placed:
    site: RoutableSite
    work_s: float = 0.0
    tokens: int = 0
    blocks: set[int] = field(default_factory=set)
    served: int = -1

    def match(self, request: RoutingRequest) -> PrefixMatch:
        """What the site caches of the prompt, or holds from this batch, the longer."""
        cached = self.site.prefix.match(request)
        ids = request.block_ids(HISTORY_BLOCK_TOKENS) if request.prompt_token_ids else ()
        run = 0
        while run < len(ids) and ids[run] in self.blocks:
            run += 1
        here = run * HISTORY_BLOCK_TOKENS
        return cached if cached.cached_tokens >= here else PrefixMatch(here, here)


def cost_assign(
    queries: Sequence[CostQuery], sites: Sequence[RoutableSite], model: CompletionCostModel
) -> list[Assignment]:
    """Contract: one Assignment per query, in the order of `queries`, by the module docstring's
    rule; site None only when there is no site. Raises ValueError on duplicate query ids."""
    if len({q.id for q in queries}) != len(queries):
        raise ValueError("query ids must be unique within a batch")
    if not sites:
        return [Assignment(q.id, None, None, None, "no site to assign to") for q in queries]
    placed = [_Placed(site, tokens=site.outstanding_tokens) for site in sites]
    order = sorted(queries, key=lambda q: (-q.bucket, -q.request.total_tokens))
    results: dict[str, Assignment] = {}
    for n, query in enumerate(order):
        request = query.request
        estimates = [(p, model.estimate(request, p.site, p.match(request))) for p in placed]
        best, estimate = min(
            estimates,
            key=lambda pe: (pe[1].cost_s + pe[0].work_s, pe[0].served, pe[0].site.name),
        )
        step_share = estimate.decode_s / max(1, best.site.latency.batch_slots or 1)
        best.work_s += estimate.prefill_s + step_share
        best.tokens += request.total_tokens
        best.served = n
        if request.prompt_token_ids:
            best.blocks.update(request.block_ids(HISTORY_BLOCK_TOKENS))
        finish = estimate.completion_s + best.work_s
        results[query.id] = Assignment(
            query.id,
            best.site.name,
            best.tokens,
            normalized(best.tokens, best.site.capacity_weight),
            f"bucket {query.bucket}: least estimated completion {finish:.3f}s "
            f"({estimate.cached_tokens} of {request.prompt_tokens} prompt tokens cached)",
        )
    return [results[q.id] for q in queries]
