"""Properties of the MICO batch form, checked on generated inputs."""

from __future__ import annotations

import random
import statistics
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.mico import Assignment, BatchQuery, BatchSite, mico_assign

WEIGHTS = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])


@st.composite
def batch_sites(draw: st.DrawFn, kv: bool = True) -> list[BatchSite]:
    count = draw(st.integers(1, 6))
    free = st.none() | st.integers(0, 3000) if kv else st.none()
    return [
        BatchSite(f"s{i}", draw(WEIGHTS), draw(st.integers(0, 2000)), draw(free))
        for i in range(count)
    ]


QUERIES = st.lists(
    st.tuples(st.integers(0, 300), st.integers(0, 500), st.integers(0, 9)), max_size=60
).map(lambda rows: [BatchQuery(f"q{i}", p, a, b) for i, (p, a, b) in enumerate(rows)])


def placed_tokens(queries: list[BatchQuery], result: list[Assignment]) -> dict[str, int]:
    by_id = {query.id: query for query in queries}
    placed: dict[str, int] = defaultdict(int)
    for assignment in result:
        if assignment.site is not None:
            placed[assignment.site] += by_id[assignment.query_id].tokens
    return placed


def final_loads(sites: list[BatchSite], placed: dict[str, int]) -> list[float]:
    return [(s.outstanding_tokens + placed[s.name]) / s.capacity_weight for s in sites]


@settings(deadline=None)
@given(batch_sites(), QUERIES)
def test_every_query_is_answered_once_and_kv_holds(sites, queries) -> None:
    result = mico_assign(queries, sites)
    assert [a.query_id for a in result] == [q.id for q in queries]
    placed = placed_tokens(queries, result)
    for site in sites:
        if site.kv_free_tokens is not None:
            assert placed[site.name] <= site.kv_free_tokens
    for query, assignment in zip(queries, result, strict=True):
        if assignment.site is None:  # only when it fits nowhere, even at the end
            assert all(
                s.kv_free_tokens is not None and query.tokens > s.kv_free_tokens - placed[s.name]
                for s in sites
            )


@settings(deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.integers(0, 2000), min_size=8, max_size=8),
    st.integers(1, 400),
    st.lists(st.integers(0, 9), max_size=80),
)
def test_equal_sites_and_queries_end_within_one_query(count, loads, size, buckets) -> None:
    """The spread between equal sites never grows beyond max(spread before, one query): from
    equal loads it ends within one query's tokens."""
    sites = [BatchSite(f"s{i}", 1.0, loads[i]) for i in range(count)]
    queries = [BatchQuery(f"q{i}", size // 3, size - size // 3, b) for i, b in enumerate(buckets)]
    after = final_loads(sites, placed_tokens(queries, mico_assign(queries, sites)))
    before = [float(load) for load in loads[:count]]
    assert max(after) - min(after) <= max(max(before) - min(before), size)
    even = [BatchSite(s.name, 1.0) for s in sites]
    after = final_loads(even, placed_tokens(queries, mico_assign(queries, even)))
    assert max(after) - min(after) <= size


@settings(deadline=None)
@given(st.integers(1, 300), st.integers(1, 400), st.integers(1, 4))
def test_a_site_of_twice_the_capacity_gets_two_thirds(count, size, buckets) -> None:
    sites = [BatchSite("small", 1.0), BatchSite("big", 2.0)]
    queries = [BatchQuery(f"q{i}", 0, size, i % buckets) for i in range(count)]
    big = sum(a.site == "big" for a in mico_assign(queries, sites))
    assert abs(big - 2 * count / 3) <= 1


def round_robin_max_load(queries: list[BatchQuery], sites: list[BatchSite]) -> float:
    placed: dict[str, int] = defaultdict(int)
    ordered = sorted(sites, key=lambda s: s.name)
    for i, query in enumerate(queries):
        placed[ordered[i % len(ordered)].name] += query.tokens
    return max(final_loads(sites, placed))


def test_batch_form_beats_round_robin_on_max_normalized_load() -> None:
    """Measured, not proven: a greedy heuristic can lose to round robin on an input where round
    robin's order happens to be ideal. Over 1,000 seeded random batches (1-9 sites, mixed
    weights and loads, up to 200 queries) MICO lost on 1 of them, by 0.9%;
    the test bounds the share of losses, the worst loss and the mean ratio."""
    rnd = random.Random(20240607)
    ratios = []
    for _ in range(1000):
        sites = [
            BatchSite(f"s{i}", rnd.choice([0.5, 1.0, 1.0, 2.0, 3.0]), rnd.choice([0, 0, 1500]))
            for i in range(rnd.randint(1, 9))
        ]
        queries = []
        for i in range(rnd.randint(1, 200)):
            bucket = rnd.randint(0, 9)
            queries.append(BatchQuery(f"q{i}", rnd.randint(1, 300), bucket * 50 + 25, bucket))
        mico = max(final_loads(sites, placed_tokens(queries, mico_assign(queries, sites))))
        ratios.append(mico / round_robin_max_load(queries, sites))
    assert sum(r > 1 + 1e-9 for r in ratios) <= 10
    assert max(ratios) <= 1.02
    assert statistics.mean(ratios) <= 0.75
