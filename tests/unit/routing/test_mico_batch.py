"""Hand-computed cases of the MICO batch rule (see gateway/routing/mico.py's docstring)."""

from __future__ import annotations

import pytest

from gateway.routing.mico import BatchQuery, BatchSite, mico_assign
from tests.unit.routing.sites import Site


def q(qid: str, tokens: int, bucket: int) -> BatchQuery:
    return BatchQuery(
        qid, prompt_tokens=tokens // 2, predicted_tokens=tokens - tokens // 2, bucket=bucket
    )


def site(name: str, weight: float = 1.0, load: int = 0, kv: int | None = None) -> BatchSite:
    return BatchSite(name, weight, outstanding_tokens=load, kv_free_tokens=kv)


CASES = {
    # Level 200 each; turns A, B, A, B.
    "even split": (
        [site("a"), site("b")],
        [q("1", 100, 3), q("2", 100, 3), q("3", 100, 3), q("4", 100, 3)],
        [("1", "a", 100), ("2", "b", 100), ("3", "a", 200), ("4", "b", 200)],
    ),
    # Weights 2:1, level 100 per unit of weight: big's target 200, small's 100.
    "capacity 2:1": (
        [site("small", 1.0), site("big", 2.0)],
        [q("1", 100, 1), q("2", 100, 1), q("3", 100, 1)],
        [("1", "big", 100), ("2", "small", 100), ("3", "big", 200)],
    ),
    # Bucket 5: 4 queries over 3 sites, level 133.3: one each, "4" borrowed into bucket 2,
    # placed first there on the least recently served of the equal sites (a). Bucket 2 then
    # deals its own two queries to b and c (a's room is used up by the borrowed query).
    "group not divisible": (
        [site("a"), site("b"), site("c")],
        [*(q(str(i), 100, 5) for i in range(1, 5)), q("5", 40, 2), q("6", 40, 2)],
        [
            ("1", "a", 100),
            ("2", "b", 100),
            ("3", "c", 100),
            ("4", "a", 200),
            ("5", "b", 140),
            ("6", "c", 140),
        ],
    ),
    # Longest bucket first even when it comes last in the input.
    "longest bucket first": (
        [site("a"), site("b")],
        [q("short", 10, 0), q("long", 500, 9)],
        [("short", "b", 10), ("long", "a", 500)],
    ),
    # a is ahead by 300 tokens: level 300, a's target is 0, so b takes all three.
    "loaded site gets nothing": (
        [site("a", load=300), site("b")],
        [q("1", 100, 1), q("2", 100, 1), q("3", 100, 1)],
        [("1", "b", 100), ("2", "b", 200), ("3", "b", 300)],
    ),
    # a's free KV (50) holds nothing: it would have been first by name.
    "kv bound excludes a site": (
        [site("a", kv=50), site("b"), site("c")],
        [q("1", 100, 1), q("2", 100, 1)],
        [("1", "b", 100), ("2", "c", 100)],
    ),
    # Level 150: "1" (200) fits no target and is borrowed; "2" goes to a, whose KV is then at
    # 50; the leftover "1" only fits b.
    "kv bound after this batch's own placements": (
        [site("a", kv=150), site("b")],
        [q("1", 200, 1), q("2", 100, 1)],
        [("1", "b", 200), ("2", "a", 100)],
    ),
    "fits nowhere": (
        [site("a", kv=100), site("b", kv=100)],
        [q("1", 150, 1), q("2", 80, 1)],
        [("1", None, None), ("2", "a", 80)],
    ),
    "empty batch": ([site("a")], [], []),
    "no site": ([], [q("1", 10, 0)], [("1", None, None)]),
}


@pytest.mark.parametrize(("sites", "queries", "expected"), CASES.values(), ids=CASES.keys())
def test_mico_assign(sites, queries, expected) -> None:
    result = mico_assign(queries, sites)
    assert [(a.query_id, a.site, a.tokens_after) for a in result] == expected


def test_assignment_explains_itself() -> None:
    sites = [site("a", kv=200), site("b", kv=200), site("c", kv=200)]
    queries = [q("1", 90, 5), q("2", 90, 5), q("3", 90, 5), q("4", 90, 5), q("5", 10, 2)]
    queries += [q("6", 250, 9), q("7", 20, 0)]
    why = {a.query_id: a.why for a in mico_assign(queries, sites)}
    assert why == {
        "1": "bucket 5: turn toward level 120.0",
        "2": "bucket 5: turn toward level 120.0",
        "3": "bucket 5: turn toward level 120.0",
        "4": "bucket 2: borrowed from bucket 5",
        "5": "bucket 2: turn toward level 123.3",
        "6": "fits no site's free KV: needs 250 tokens, most free 200",
        # Level 105 leaves c a target of 15 and b of 5: 20 fits neither, and there is no next
        # group to borrow into.
        "7": "left over from bucket 0: least loaded after",
    }


def test_load_after_is_normalized_by_capacity() -> None:
    (only,) = mico_assign([q("1", 100, 1)], [site("big", weight=4.0, load=100)])
    assert (only.tokens_after, only.load_after) == (200, 50.0)


@pytest.mark.parametrize(
    ("sites", "queries", "message"),
    [
        ([site("a")], [q("1", 10, 0), q("1", 20, 0)], "query ids"),
        ([site("a"), site("a")], [q("1", 10, 0)], "site names"),
        ([site("a", weight=0.0)], [q("1", 10, 0)], "capacity weight"),
        ([site("a")], [BatchQuery("1", -1, 5, 0)], "token counts"),
    ],
)
def test_bad_input_is_refused(sites, queries, message) -> None:
    with pytest.raises(ValueError, match=message):
        mico_assign(queries, sites)


def test_batch_site_reads_a_routable_site() -> None:
    live = Site("a", capacity_weight=2.0, kv_capacity_tokens=1000, outstanding_tokens=300)
    assert BatchSite.of(live) == BatchSite("a", 2.0, outstanding_tokens=300, kv_free_tokens=700)
