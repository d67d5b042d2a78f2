"""Table tests of the cost model and of the parts around it: completion_cost (the federation's
policy), kv_room, hot_spot_guard, session affinity, and the peers' rules (prefix_match,
dynamo_cost)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.routing.affinity import DynamoCost, PrefixMatchScorer, SessionAffinity
from gateway.routing.completion_cost import (
    CompletionCost,
    CompletionCostModel,
    HotSpotGuard,
    KvRoomFilter,
)
from gateway.routing.filters import SlotRoomFilter
from gateway.routing.policy import build_policy
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.types import RoutingRequest, SiteLatency, StepTime
from tests.unit.routing.sites import KnownPrefix, Site, lowest, request

MODEL = CompletionCostModel(prefill_tokens_per_s=1000.0, host_ratio=0.1)
STEP = StepTime(0.01)  # 10 ms a step at any batch
IDLE = Site("idle", latency=SiteLatency(step=STEP, batch_slots=8))


@pytest.mark.parametrize(
    ("req", "site", "terms"),
    [
        # rtt + queue + prefill + decode = 0 + 0 + 500/1000 + 9 steps of 10 ms
        (request(500, 10), IDLE, (0.0, 0.0, 0.5, 0.09)),
        (request(500, 10), replace(IDLE, latency=SiteLatency(rtt_s=0.15, step=STEP)),
         (0.15, 0.0, 0.5, 0.09)),
        # 2,000 prompt tokens queued ahead: 2 s
        (request(500, 10), replace(IDLE, queued_tokens=2000), (0.0, 2.0, 0.5, 0.09)),
        # 400 of the prompt cached on the device: 100 to compute
        (request(500, 10), replace(IDLE, prefix=KnownPrefix(400)), (0.0, 0.0, 0.1, 0.09)),
        # ... of them 200 in host memory: they come back at a tenth of the cost
        (request(500, 10), replace(IDLE, prefix=KnownPrefix(400, 200)), (0.0, 0.0, 0.12, 0.09)),
        # a whole prompt cached: its last token is computed all the same
        (request(500, 10), replace(IDLE, prefix=KnownPrefix(500)), (0.0, 0.0, 0.001, 0.09)),
        # full batch (2 slots, 4 present, 400 answer tokens left): waits for 3 of 100 each,
        # one every 100 * 10 ms / 2
        (request(500, 10),
         replace(IDLE, latency=SiteLatency(step=STEP, batch_slots=2, requests=4,
                                           remaining_answer_tokens=400)),
         (0.0, 1.5, 0.5, 0.09)),
        # the planned answer is the prediction, capped at max_tokens
        (request(500, 10, predicted=3), IDLE, (0.0, 0.0, 0.5, 0.02)),
        # a configured prefill rate wins over the model's default
        (request(500, 10), replace(IDLE, prefill_tokens_per_s=5000.0), (0.0, 0.0, 0.1, 0.09)),
    ],
)  # fmt: skip
def test_completion_cost_terms(req, site, terms) -> None:
    estimate = MODEL.estimate(req, site)
    got = (estimate.rtt_s, estimate.queue_s, estimate.prefill_s, estimate.decode_s)
    assert got == pytest.approx(terms)
    assert CompletionCost(MODEL).cost(req, site) == pytest.approx(sum(terms) + estimate.others_s)


SLOPED = StepTime(0.01, 0.001)  # 10 ms + 1 ms a sequence


def running(n: int, left: int, slots: int = 8, cached: int = 0) -> Site:
    latency = SiteLatency(step=SLOPED, batch_slots=slots, requests=n, remaining_answer_tokens=left)
    return Site("busy", latency=latency, prefix=KnownPrefix(cached))


@pytest.mark.parametrize(
    ("site", "weight", "others"),
    [
        (IDLE, 1.0, 0.0),  # nobody there to slow down
        # 4 running, 100 answer tokens left each: each waits out its 0.5 s prefill, then runs
        # its 9 decode steps at batch 5 instead of 4 (1 ms more a step)
        (running(4, 400), 1.0, 4 * (0.5 + 9 * 0.001)),
        (running(4, 400), 0.5, 2 * (0.5 + 9 * 0.001)),
        (running(4, 400), 0.0, 0.0),
        # they have 2 tokens left each: slowed for 2 steps, not 9
        (running(4, 8), 1.0, 4 * (0.5 + 2 * 0.001)),
        # 400 of the prompt cached: a 0.1 s prefill stalls them
        (running(4, 400, cached=400), 1.0, 4 * (0.1 + 9 * 0.001)),
        # a full batch (2 slots, 4 present): it waits for a slot, the batch stays at 2, only
        # its prefill stalls the 2 running
        (running(4, 400, slots=2), 1.0, 2 * 0.5),
    ],
)  # fmt: skip
def test_the_delay_it_adds_to_the_running_requests(site, weight, others) -> None:
    model = replace(MODEL, others_weight=weight)
    estimate = model.estimate(request(500, 10), site)
    assert estimate.others_s == pytest.approx(others)
    assert estimate.cost_s == pytest.approx(estimate.completion_s + others)


def test_a_long_prompt_goes_where_it_stalls_fewer_requests() -> None:
    # The busy site steps faster (its own ECT is lower), but its 2 s prefill would stall 30
    # running requests there against 2 at the quiet one.
    busy = Site("busy", latency=SiteLatency(step=StepTime(0.008), batch_slots=64, requests=30,
                                            remaining_answer_tokens=3000))  # fmt: skip
    quiet = Site("quiet", latency=SiteLatency(step=StepTime(0.012), batch_slots=64, requests=2,
                                              remaining_answer_tokens=200))  # fmt: skip
    req = request(2000, 200)
    assert MODEL.estimate(req, busy).completion_s < MODEL.estimate(req, quiet).completion_s
    for weight, chosen in ((1.0, "quiet"), (0.0, "busy")):
        cost = CompletionCost(replace(MODEL, others_weight=weight))
        decision = lowest(cost).route(req, [busy, quiet])
        assert decision.site is not None
        assert decision.site.name == chosen


NEAR_BUSY = Site("near", queued_tokens=3000, latency=SiteLatency(rtt_s=0.005, step=STEP))
FAR_IDLE = Site("far", latency=SiteLatency(rtt_s=0.15, step=STEP))
CACHED = Site("cached", prefix=KnownPrefix(900), queued_tokens=300, latency=SiteLatency(step=STEP))
COLD = Site("cold", latency=SiteLatency(step=STEP))


@pytest.mark.parametrize(
    ("req", "sites", "chosen"),
    [
        # 3 s of prefills queued near against 150 ms of round trip far away
        (request(1000, 10), [NEAR_BUSY, FAR_IDLE], "far"),
        # 900 of 1,000 cached (0.1 s to compute) despite 0.3 s queued, against 1 s cold
        (request(1000, 10), [CACHED, COLD], "cached"),
        # the same cache behind 3 s of queue: computing it all elsewhere is faster
        (request(1000, 10), [replace(CACHED, queued_tokens=3000), COLD], "cold"),
    ],
)
def test_the_lowest_completion_cost_wins(req, sites, chosen) -> None:
    decision = lowest(CompletionCost(MODEL)).route(req, sites)
    assert decision.site is not None
    assert decision.site.name == chosen


@pytest.mark.parametrize(
    ("sites", "kept"),
    [
        # 60 tokens on a site with 50 free: out, unless 20 of its tokens are cached on device
        ([Site("a", kv_capacity_tokens=100, outstanding_tokens=50), Site("b")], ["b"]),
        ([Site("a", kv_capacity_tokens=100, outstanding_tokens=50, prefix=KnownPrefix(20)),
          Site("b")], ["a", "b"]),
        # cached in host memory only: it must come back, it takes room
        ([Site("a", kv_capacity_tokens=100, outstanding_tokens=50, prefix=KnownPrefix(20, 0)),
          Site("b")], ["b"]),
        # nowhere now: where it could ever fit (it waits there)
        ([Site("a", kv_capacity_tokens=100, outstanding_tokens=100),
          Site("c", kv_capacity_tokens=50, outstanding_tokens=0)], ["a"]),
    ],
)  # fmt: skip
def test_kv_room_counts_cached_device_blocks_as_resident(sites, kept) -> None:
    assert [s.name for s in KvRoomFilter()(request(30, 30), sites)] == kept


def queued(name: str, tokens: int) -> Site:
    return Site(name, queued_tokens=tokens, latency=SiteLatency(step=STEP))


@pytest.mark.parametrize(
    ("queues", "kept"),
    [
        ([0, 0, 0], ["s0", "s1", "s2"]),
        ([0, 900, 1100], ["s0", "s1"]),  # 1.1 s above the least: out (0.9 s is not)
        ([3000, 5000, 7100], ["s0", "s1"]),  # 4.1 s above, 2.37x: out; 2 s above, 1.67x: in
        ([5000], ["s0"]),  # a lone site is never left out
    ],
)
def test_hot_spot_guard(queues, kept) -> None:
    guard = HotSpotGuard(MODEL, ratio=2.0, margin_s=1.0)
    sites = [queued(f"s{i}", tokens) for i, tokens in enumerate(queues)]
    assert [s.name for s in guard(request(), sites)] == kept


@pytest.mark.parametrize(
    ("cached", "values"),
    [
        ([0, 0, 0], (0.0, 0.0, 0.0)),
        ([64, 0, 128], (0.5, 0.0, 1.0)),
    ],
)
def test_prefix_match_scorer(cached, values) -> None:
    sites = [Site(f"s{i}", prefix=KnownPrefix(c)) for i, c in enumerate(cached)]
    assert PrefixMatchScorer().score(request(200), sites).values == values


@pytest.mark.parametrize(
    ("site", "cost"),
    [
        # (prompt 160 - cached 0)/16 + (ledger 0 + 160)/16
        (Site("a"), 20.0),
        (Site("a", prefix=KnownPrefix(96)), 14.0),
        (Site("a", ledger_tokens=320), 40.0),
    ],
)
def test_dynamo_cost(site, cost) -> None:
    assert DynamoCost().cost(request(160, 10), site) == cost


def test_session_affinity_remembers_the_last_site_of_each_session() -> None:
    affinity = SessionAffinity(max_sessions=2)
    a, b = Site("a"), Site("b")
    assert affinity.score(request(session="s1"), [a, b]).values == (0.0, 0.0)
    affinity.routed(request(session="s1"), b)
    affinity.routed(request(), a)  # no session: nothing to remember
    assert affinity.score(request(session="s1"), [a, b]).values == (0.0, 1.0)
    assert affinity.score(request(), [a, b]).values == (0.0, 0.0)
    affinity.routed(request(session="s2"), a)
    affinity.routed(request(session="s3"), a)  # s1 is the least recent of three: forgotten
    assert affinity.score(request(session="s1"), [a, b]).values == (0.0, 0.0)


def conversation(turn: int, session: str = "chat-1") -> RoutingRequest:
    """Turn n re-sends every earlier turn (300 tokens each) and adds its own."""
    tokens = tuple(range(1, 300 * turn + 1))
    return RoutingRequest("m", len(tokens), 50, 50, prompt_token_ids=tokens, session_key=session)


def sites(*queues: int) -> list[Site]:
    return [
        Site(f"s{i}", queued_tokens=q, prefix=SitePrefix(1000), latency=SiteLatency(step=STEP))
        for i, q in enumerate(queues)
    ]


def test_a_conversations_next_turn_goes_where_its_first_one_was_served() -> None:
    policy, federation = build_policy("completion_cost"), sites(0, 0, 0)
    first = policy.route(conversation(1), federation).site
    assert first is not None
    for turn in (2, 3):
        assert policy.route(conversation(turn), federation).site == first


def test_unless_that_site_is_overloaded() -> None:
    policy, federation = build_policy("completion_cost"), sites(0, 0, 0)
    first = policy.route(conversation(1), federation).site
    assert first is not None
    hot = federation.index(first)
    federation[hot] = replace(first, queued_tokens=200_000)  # 10 s of prefills queued there
    second = policy.route(conversation(2), federation)
    assert second.site is not None
    assert second.site.name != first.name
    assert dict(second.survivors)["hot_spot_guard"] == 2


def test_pure_prefix_affinity_makes_the_hot_spot_it_is_known_for() -> None:
    policy, federation = build_policy("prefix_affinity"), sites(0, 0, 0)
    shared = tuple(range(1, 513))  # a system prompt every conversation starts with
    chosen = set()
    for user in range(12):
        tokens = (*shared, *range(10_000 * (user + 1), 10_000 * (user + 1) + 100))
        site = policy.route(RoutingRequest("m", len(tokens), 10, prompt_token_ids=tokens),
                            federation).site  # fmt: skip
        assert site is not None
        chosen.add(site.name)
    assert len(chosen) == 1


def _at(name: str, present: int, slots: int | None) -> Site:
    return Site(name, latency=SiteLatency(step=STEP, batch_slots=slots, requests=present))


@pytest.mark.parametrize(
    ("sites", "kept"),
    [
        # a full site is left out while another has a free slot
        ([_at("full", 16, 16), _at("room", 63, 64)], ["room"]),
        ([_at("over", 20, 16), _at("room", 0, 8), _at("room2", 7, 8)], ["room", "room2"]),
        # every site full: all stay (the cost model's queue term chooses where to wait)
        ([_at("a", 16, 16), _at("b", 70, 64)], ["a", "b"]),
        # slots unknown (no info yet): counts as room
        ([_at("full", 8, 8), _at("unknown", 100, None)], ["unknown"]),
        ([_at("full", 8, 8), _at("says_zero", 5, 0)], ["says_zero"]),  # an engine that does not say
        ([], []),
    ],
)
def test_slot_room_keeps_the_sites_with_a_free_batch_slot(sites, kept) -> None:
    assert [s.name for s in SlotRoomFilter()(request(), sites)] == kept
