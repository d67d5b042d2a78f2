"""The order of the gateway's queue (gateway/routing/hold_order.py): classes first, FCFS or SPF
with aging within one, the bound on overtaking; the pass that offers held requests to routing;
and which "no site" decisions may be held."""

from __future__ import annotations

import random

import pytest

from fedllm_contract.priority import Priority
from gateway.routing.hold_order import (
    HeldRequests,
    HoldOrder,
    max_inversions,
    most_overtaken,
    offer,
    pushed_back,
)
from gateway.routing.profile import Decision

INTER, BATCH = Priority.INTERACTIVE, Priority.BATCH


def _hold_all(queue: HeldRequests[str], requests: list[tuple[str, Priority, int]]) -> None:
    for name, priority, planned in requests:
        queue.hold(name, priority, planned)


def test_fcfs_serves_in_arrival_order_with_the_classes_first() -> None:
    queue: HeldRequests[str] = HeldRequests(HoldOrder("fcfs"))
    _hold_all(queue, [("b1", BATCH, 5), ("i1", INTER, 900), ("b2", BATCH, 1), ("i2", INTER, 3)])
    assert [e.item for e in queue] == ["i1", "i2", "b1", "b2"]


def test_spf_serves_the_shortest_planned_answer_first_within_a_class() -> None:
    queue: HeldRequests[str] = HeldRequests(HoldOrder("spf", aging=1.0, max_overtakes=None))
    _hold_all(queue, [("long", INTER, 500), ("short", INTER, 20), ("batch", BATCH, 1),
                      ("mid", INTER, 100)])  # fmt: skip
    assert [e.item for e in queue] == ["short", "mid", "long", "batch"]


def test_the_bound_puts_a_long_request_ahead_of_every_arrival_after_the_next_k() -> None:
    queue: HeldRequests[str] = HeldRequests(HoldOrder("spf", aging=1.0, max_overtakes=3))
    queue.hold("long", INTER, 10_000)
    for i in range(6):
        queue.hold(f"s{i}", INTER, 1)
    # s0..s2 (the 3 right after it) rank ahead; from s3 on, every later one ranks behind.
    assert [e.item for e in queue] == ["s0", "s1", "s2", "long", "s3", "s4", "s5"]


def _serve_randomly(seed: int, order: HoldOrder, arrivals: int) -> int:
    """Random arrivals (a few very long plans) and services, the queue growing: the most
    overtaken any request was."""
    rng = random.Random(seed)
    queue: HeldRequests[int] = HeldRequests(order)
    served = []
    for i in range(arrivals):
        queue.hold(
            i, rng.choice([INTER, BATCH]), 900 if rng.random() < 0.05 else rng.randint(1, 40)
        )
        if rng.random() < 0.9:
            head = next(iter(queue))
            queue.release(head)
            served.append(head)
    while queue:
        head = next(iter(queue))
        queue.release(head)
        served.append(head)
    assert sorted(e.item for e in served) == list(range(arrivals))  # every one served once
    return most_overtaken(served)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("aging", "bound"), [(1.0, 16), (0.3, 50), (2.0, 0)])
def test_no_held_request_is_overtaken_by_more_than_the_bound(
    seed: int, aging: float, bound: int
) -> None:
    assert _serve_randomly(seed, HoldOrder("spf", aging, bound), 1_500) <= bound
    assert _serve_randomly(seed, HoldOrder("spf", aging, None), 1_500) > bound
    assert _serve_randomly(seed, HoldOrder("fcfs"), 1_500) == 0


def test_releasing_what_is_not_held_is_an_error() -> None:
    queue: HeldRequests[str] = HeldRequests(HoldOrder("spf"))
    entry = queue.hold("a", INTER, 5)
    queue.release(entry)
    with pytest.raises(ValueError, match="not held"):
        queue.release(entry)
    assert not queue
    assert queue.arrivals == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "lifo"}, "queue order"),
        ({"aging": -1.0}, "aging"),
        ({"max_overtakes": -1}, "bound"),
    ],
)
def test_a_bad_order_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HoldOrder(**kwargs)  # type: ignore[arg-type]


def test_a_pass_places_in_order_and_a_refusal_holds_back_only_its_own_group() -> None:
    queue: HeldRequests[tuple[str, str]] = HeldRequests(HoldOrder("fcfs"))
    for name, model in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"), ("c1", "c")]:
        queue.hold((name, model), INTER, 1)
    room = {"a": 1, "b": 0, "c": 5}
    tried: list[str] = []

    def place(item: tuple[str, str]) -> bool:
        tried.append(item[0])
        if room[item[1]] == 0:
            return False
        room[item[1]] -= 1
        return True

    placed = offer(queue, place, lambda item: item[1])
    assert [e.item[0] for e in placed] == ["a1", "c1"]
    # a2 was offered (a still seemed open) and refused; b2 never was, once b1 found no site.
    assert tried == ["a1", "b1", "a2", "c1"]
    assert [e.item[0] for e in queue] == ["b1", "a2", "b2"]


def _decision(survivors: list[tuple[str, int]]) -> Decision[str]:
    return Decision(None, "p", tuple(survivors))


@pytest.mark.parametrize(
    ("survivors", "held"),
    [
        ([("serves_model", 2), ("healthy", 2), ("queue_bound", 0), ("kv_room", 0)], True),
        ([("serves_model", 2), ("healthy", 0), ("queue_bound", 0)], False),  # none healthy
        ([("serves_model", 0), ("queue_bound", 0)], False),  # nobody serves it
        ([("serves_model", 2), ("queue_bound", 2), ("kv_bound", 0)], False),  # never fits
        ([("serves_model", 2), ("queue_bound", 2)], False),  # a picker that chose nothing
    ],
)
def test_only_a_request_every_site_pushes_back_is_held(
    survivors: list[tuple[str, int]], held: bool
) -> None:
    assert pushed_back(_decision(survivors)) is held


def test_inversions_are_counted_within_a_class() -> None:
    # Arrival 0 is served after 1 and 2 of its class (2), but the batch one ahead of it does
    # not count; 3 after nothing later.
    assert max_inversions([(1, 1), (0, 5), (1, 2), (1, 0), (1, 3)]) == 2
    assert max_inversions([]) == 0
