"""Routing profiles from configuration: the registered parts (filters, scorers, pickers) by name,
the built-in profiles, and `build_profile`, which turns a ProfileSettings into a RoutingProfile.

Adding a policy is adding a profile here (or in the federation file), not a branch in code. The
built-in profiles keep the names GATEWAY_ROUTING_POLICY has always taken; each is built fresh,
with its own turn counters and tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gateway.routing.adapter_affinity import (
    DEFAULT_HOST_VALUE,
    AdapterAffinity,
    AdapterRouting,
    RecordAdapter,
    reads_adapters,
)
from gateway.routing.affinity import (
    DynamoCost,
    PrefixMatchScorer,
    RecordPrefix,
    SessionAffinity,
    reads_prefix,
)
from gateway.routing.completion_cost import (
    DEFAULT_ADAPTER_HOST_S,
    DEFAULT_ADAPTER_LOAD_S,
    DEFAULT_HOST_RATIO,
    DEFAULT_OTHERS_WEIGHT,
    DEFAULT_PREFILL_TOKENS_PER_S,
    CompletionCost,
    CompletionCostModel,
    HotSpotGuard,
    KvRoomFilter,
)
from gateway.routing.costs import LedgerTokensCost, RequestCountCost, TokenLoadCost
from gateway.routing.filters import (
    FitsContextFilter,
    HealthyFilter,
    KvBoundFilter,
    NotDrainingFilter,
    QueueBoundFilter,
    ServesModelFilter,
    SlotRoomFilter,
)
from gateway.routing.latency import LatencyModel, PredictedCompletionCost
from gateway.routing.pickers import TIE_KEYS, MaxScorePicker, RoundRobinPicker
from gateway.routing.profile import RoutingProfile, WeightedScorer
from gateway.routing.profile_settings import Params, PartSettings, ProfileSettings
from gateway.routing.scorers import NORMALIZATIONS, LowestCost, Normalization
from gateway.routing.types import RoutingObserver, SiteCost, SiteFilter, SitePicker, SiteScorer


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What the gateway's settings give every profile: the queue bounds (None: unbounded) and
    how it treats LoRA adapters (adapter_affinity.AdapterRouting)."""

    max_site_queue: int | None = None
    max_site_queued_tokens: int | None = None
    adapter_routing: AdapterRouting = "affinity"


P = TypeVar("P")
FilterFactory = Callable[[Params, BuildContext], SiteFilter]
ScorerFactory = Callable[[Params, BuildContext], SiteScorer]
PickerFactory = Callable[[Params, BuildContext], SitePicker]


def _lowest(cost: Callable[[Params], SiteCost]) -> ScorerFactory:
    def build(params: Params, context: BuildContext) -> SiteScorer:
        how: Normalization = "range"
        if params.choice("normalize", "range", NORMALIZATIONS) == "ratio":
            how = "ratio"
        return LowestCost(cost(params), how)

    return build


def _cost_model(params: Params, context: BuildContext) -> CompletionCostModel:
    return CompletionCostModel(
        prefill_tokens_per_s=params.number(
            "prefill_tokens_per_s", DEFAULT_PREFILL_TOKENS_PER_S, minimum=1.0
        ),
        host_ratio=params.number("host_ratio", DEFAULT_HOST_RATIO),
        others_weight=params.number("others_weight", DEFAULT_OTHERS_WEIGHT),
        adapter_load_s=params.number("adapter_load_s", DEFAULT_ADAPTER_LOAD_S),
        adapter_host_s=params.number("adapter_host_s", DEFAULT_ADAPTER_HOST_S),
        adapter_blind=context.adapter_routing == "blind",
    )


def _dynamo_cost(params: Params) -> SiteCost:
    block_tokens = params.integer("block_tokens", 16, minimum=1)
    return DynamoCost(params.number("overlap_weight", 1.0), block_tokens or 16)


def _ratio_default(cost: Callable[[Params], SiteCost]) -> ScorerFactory:
    """A cost scorer normalized by ratio unless the profile says otherwise."""

    def build(params: Params, context: BuildContext) -> SiteScorer:
        how = params.choice("normalize", "ratio", NORMALIZATIONS)
        return LowestCost(cost(params), "ratio" if how == "ratio" else "range")

    return build


def _latency_cost(params: Params) -> SiteCost:
    chunk = params.integer("prefill_chunk_tokens", LatencyModel().prefill_chunk_tokens, minimum=1)
    return PredictedCompletionCost(LatencyModel(prefill_chunk_tokens=chunk or 1))


FILTERS: dict[str, FilterFactory] = {
    "serves_model": lambda p, c: ServesModelFilter(),
    "healthy": lambda p, c: HealthyFilter(),
    "fits_context": lambda p, c: FitsContextFilter(),
    "not_draining": lambda p, c: NotDrainingFilter(),
    "queue_bound": lambda p, c: QueueBoundFilter(
        p.integer("max_requests", c.max_site_queue, minimum=1),
        p.integer("max_tokens", c.max_site_queued_tokens, minimum=1),
    ),
    "kv_bound": lambda p, c: KvBoundFilter(),
    "kv_room": lambda p, c: KvRoomFilter(),
    "slot_room": lambda p, c: SlotRoomFilter(),
    "hot_spot_guard": lambda p, c: HotSpotGuard(
        _cost_model(p, c), p.number("ratio", 2.0, minimum=1.0), p.number("margin_s", 1.0)
    ),
}
SCORERS: dict[str, ScorerFactory] = {
    "least_requests": _lowest(lambda p: RequestCountCost()),
    "least_tokens": _lowest(lambda p: TokenLoadCost()),
    "least_tokens_guess": _lowest(lambda p: LedgerTokensCost()),
    "least_latency": _lowest(_latency_cost),
    "completion_cost": lambda p, c: _ratio_default(
        lambda q: CompletionCost(_cost_model(q, c), reads_adapters=c.adapter_routing != "blind")
    )(p, c),
    "prefix_match": lambda p, c: PrefixMatchScorer(),
    "dynamo_cost": _lowest(_dynamo_cost),
    "adapter_affinity": lambda p, c: AdapterAffinity(p.number("host_value", DEFAULT_HOST_VALUE)),
    "session_affinity": lambda p, c: SessionAffinity(
        p.integer("max_sessions", 100_000, minimum=1) or 1
    ),
}
PICKERS: dict[str, PickerFactory] = {
    "round_robin": lambda p, c: RoundRobinPicker(),
    "max_score": lambda p, c: MaxScorePicker(TIE_KEYS[p.choice("ties", "model", tuple(TIE_KEYS))]),
}

# Every built-in profile starts with these: the request's model, healthy, its context fits, not
# drained by an operator, and the site's queue below the gateway's bounds.
BASE_FILTERS = (
    PartSettings("serves_model"),
    PartSettings("healthy"),
    PartSettings("fits_context"),
    PartSettings("not_draining"),
    PartSettings("queue_bound"),
)
_KV_BOUND = PartSettings("kv_bound")
# Against completion_cost's ratio score (a site twice as slow scores 0.5): a site holding the
# adapter in a slot keeps its requests until its cost is about 1 / (1 - 0.3) = 1.4x another's.
ADAPTER_AFFINITY_WEIGHT = 0.3


def _one_scorer(
    name: str, *extra_filters: PartSettings, ties: str = "model", scorer: str | None = None
) -> ProfileSettings:
    """The base filters (and `extra_filters`), one scorer (named as the profile by default)."""
    return ProfileSettings(
        name,
        (*BASE_FILTERS, *extra_filters),
        (PartSettings(scorer or name),),
        PartSettings.of("max_score", ties=ties),
    )


BUILT_IN: dict[str, ProfileSettings] = {
    profile.name: profile
    for profile in (
        ProfileSettings("round_robin", BASE_FILTERS, (), PartSettings("round_robin")),
        _one_scorer("least_requests"),
        _one_scorer("least_tokens"),
        _one_scorer("least_tokens_guess"),
        # MICO's online form: token balance within the KV bound, equal sites alternating per
        # predicted length bucket (gateway/routing/mico.py).
        ProfileSettings(
            "mico",
            (*BASE_FILTERS, _KV_BOUND),
            (PartSettings("least_tokens"),),
            PartSettings.of("max_score", ties="model_bucket"),
        ),
        _one_scorer("least_latency", _KV_BOUND),
        # The federation's own (gateway/routing/completion_cost.py): the lowest estimated
        # completion time with what each site caches (its prompt's blocks, its LoRA adapter),
        # within KV room, no hot spot, no full site while another has a free batch slot, a
        # conversation kept on its site while that costs at most a third more, and an
        # adapter's requests kept where the adapter is while that costs at most about 40%
        # more (gateway/routing/adapter_affinity.py; no effect on a base model's requests).
        ProfileSettings(
            "completion_cost",
            (
                *BASE_FILTERS,
                PartSettings("kv_room"),
                PartSettings("hot_spot_guard"),
                PartSettings("slot_room"),
            ),
            (
                PartSettings("completion_cost"),
                PartSettings("session_affinity", weight=0.25),
                PartSettings("adapter_affinity", weight=ADAPTER_AFFINITY_WEIGHT),
            ),
        ),
        # The peers' rules, for comparison (gateway/routing/affinity.py).
        _one_scorer("prefix_affinity", scorer="prefix_match"),
        _one_scorer("dynamo_cost"),
    )
}


def _built(
    kind: str,
    registry: Mapping[str, Callable[[Params, BuildContext], P]],
    spec: PartSettings,
    context: BuildContext,
) -> P:
    factory = registry.get(spec.name)
    if factory is None:
        raise ValueError(f"unknown {kind} {spec.name!r}; known: {sorted(registry)}")
    params = Params(f"{kind} {spec.name}", spec.param_map)
    part = factory(params, context)
    params.done()
    return part


def build_profile(settings: ProfileSettings, context: BuildContext | None = None) -> RoutingProfile:
    """Contract: the profile `settings` describes, every part fresh (its own turn counters and
    tables); parts that learn from decisions observe them. ValueError naming the profile for an
    unknown part, a bad or unknown parameter or a weight <= 0."""
    context = context or BuildContext()
    # Adapter-blind: the adapter scorer left out (the cost's adapter term is off in the model).
    blind = context.adapter_routing == "blind"
    try:
        filters = [_built("filter", FILTERS, spec, context) for spec in settings.filters]
        scorers = [
            WeightedScorer(_built("scorer", SCORERS, spec, context), spec.weight)
            for spec in settings.scorers
            if not (blind and spec.name == "adapter_affinity")
        ]
        picker = _built("picker", PICKERS, settings.picker, context)
    except ValueError as exc:
        raise ValueError(f"routing profile {settings.name!r}: {exc}") from exc
    parts: list[object] = [*filters, *(w.scorer for w in scorers), picker]
    observers: list[RoutingObserver] = [p for p in parts if isinstance(p, RoutingObserver)]
    if any(reads_prefix(part) for part in parts):
        observers.append(RecordPrefix())
    if any(reads_adapters(part) for part in parts):
        observers.append(RecordAdapter())
    costs = [w.scorer.cost for w in scorers if isinstance(w.scorer, LowestCost)]
    batch_cost = next((c.model for c in costs if isinstance(c, CompletionCost)), None)
    return RoutingProfile(
        settings.name, tuple(filters), tuple(scorers), picker, tuple(observers), batch_cost
    )


def profile_names(custom: Sequence[ProfileSettings] = ()) -> tuple[str, ...]:
    """The built-in profiles' names, then the custom ones'."""
    return (*BUILT_IN, *(p.name for p in custom))
