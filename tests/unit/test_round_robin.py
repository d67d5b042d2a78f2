"""fedllm_contract/round_robin.py: keys take turns in the order they came, each key's items
oldest first, a key served going to the back of the line (issue 75's fairness, shared by the
gateway's file checks and a site's job intake)."""

from __future__ import annotations

import pytest

from fedllm_contract.round_robin import RoundRobin


def drain(queue: RoundRobin[str, int]) -> list[tuple[str, int]]:
    out = []
    while queue:
        out.append(queue.pop())
    return out


def test_keys_take_turns_each_oldest_first() -> None:
    queue: RoundRobin[str, int] = RoundRobin()
    for key, item in [("a", 1), ("a", 2), ("a", 3), ("b", 4), ("c", 5), ("b", 6)]:
        queue.push(key, item)
    assert (len(queue), queue.count("a"), queue.count("z")) == (6, 3, 0)
    assert drain(queue) == [("a", 1), ("b", 4), ("c", 5), ("a", 2), ("b", 6), ("a", 3)]
    with pytest.raises(IndexError):
        queue.pop()


def test_an_item_requeued_after_its_turn_waits_behind_the_other_keys() -> None:
    queue: RoundRobin[str, int] = RoundRobin()
    queue.push("a", 1)
    queue.push("a", 2)
    key, first = queue.pop()
    queue.push("b", 3)  # came while a's first had its turn
    queue.requeue(key, first)
    assert drain(queue) == [("b", 3), ("a", 1), ("a", 2)]
    queue.requeue("c", 9)  # a key with nothing waiting joins the back
    assert drain(queue) == [("c", 9)]


def test_an_item_taken_out_leaves_no_turn_behind() -> None:
    queue: RoundRobin[str, int] = RoundRobin()
    for key, item in [("a", 1), ("b", 2), ("a", 3)]:
        queue.push(key, item)
    assert queue.remove("b", 2)
    assert not queue.remove("b", 2)
    assert queue.remove("a", 1)
    assert drain(queue) == [("a", 3)]


def test_a_key_just_served_waits_behind_another_even_if_its_item_came_first() -> None:
    """One worker, key a's first check running and its second waiting when key b's arrives: b's
    goes next (issue 75), not after every check a queued before it."""
    queue: RoundRobin[str, int] = RoundRobin()
    queue.push("a", 1)
    assert queue.pop() == ("a", 1)  # runs
    queue.push("a", 2)
    queue.push("b", 3)
    assert drain(queue) == [("b", 3), ("a", 2)]


def test_none_is_a_key_like_any_other() -> None:
    """The gateway's callers without an API key are one key, None."""
    queue: RoundRobin[str | None, int] = RoundRobin()
    queue.push(None, 1)
    assert queue.pop() == (None, 1)
    queue.push(None, 2)
    queue.push("b", 3)
    assert queue.pop() == ("b", 3)
    assert queue.pop() == (None, 2)
