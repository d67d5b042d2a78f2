"""bench.engine.batch_order's sizing for a short device slot: how many items of a mix hold the
tokens a probed rate finishes in the time an order may take, extrapolated past the mix's end."""

from __future__ import annotations

from bench.engine.batch_order import items_for
from bench.engine.batch_order_workload import Item


def mix(count: int) -> list[Item]:
    return [Item(tuple(range(90)), 10, 10, True) for _ in range(count)]  # 100 tokens each


def test_the_items_that_hold_the_tokens_in_order() -> None:
    assert items_for(mix(40), 1) == 1
    assert items_for(mix(40), 100) == 1
    assert items_for(mix(40), 101) == 2
    assert items_for(mix(40), 2500) == 25


def test_past_the_mix_the_count_is_extrapolated_at_its_mean() -> None:
    assert items_for(mix(40), 4000) == 40
    assert items_for(mix(40), 10_000) == 100
    assert items_for(mix(40), 10_001) == 101
