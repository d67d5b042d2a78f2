"""Steady feeding (gateway/batches/feed.py): each site holds only what its idle capacity takes,
and a batch near its deadline is granted places ahead of the others."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from fedllm_contract.priority import Priority
from gateway.batches.feed import SiteFeed, batch_room, interactive_busy, urgency
from gateway.batches.progress import estimate
from gateway.sites.interface import ClassLoadView, LoadView

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_room_is_the_sites_idle_slots_within_bounds() -> None:
    assert batch_room(slots=8, busy=0, batch_in_flight=0, cap=16) == 8
    # Our own batch items do not count against the batch.
    assert batch_room(slots=8, busy=5, batch_in_flight=5, cap=16) == 8
    # Chat holds 6 of 8 slots: the batch gets the 2 left.
    assert batch_room(slots=8, busy=8, batch_in_flight=2, cap=16) == 2
    # A site full of other work still gets one batch item: a batch always moves.
    assert batch_room(slots=8, busy=20, batch_in_flight=0, cap=16) == 1
    assert batch_room(slots=64, busy=0, batch_in_flight=0, cap=16) == 16
    assert batch_room(slots=None, busy=3, batch_in_flight=0, cap=16) == 16


def report(queued: int, running: int, *by_class: ClassLoadView) -> LoadView:
    return LoadView(queued, running, 0, 0, 0, 0, 100, 0.0, 1, 1, by_class=by_class)


def test_background_work_at_the_site_leaves_the_batch_its_room() -> None:
    # 8 slots, 2 chat requests running and 6 background ones (flex, batch items of another
    # gateway) running or queued: the batch's room is the 6 slots chat leaves, not 0.
    site = report(
        4,
        4,
        ClassLoadView(Priority.INTERACTIVE, queued_requests=0, running_requests=2),
        ClassLoadView(Priority.FLEX, queued_requests=1, running_requests=1),
        ClassLoadView(Priority.BATCH, queued_requests=3, running_requests=1),
    )
    busy = interactive_busy(site, site_in_flight=0, batch_in_flight=0)
    assert busy == 2
    assert batch_room(slots=8, busy=busy, batch_in_flight=0, cap=16) == 6
    # A site that does not report classes: all its work counts, as before.
    assert interactive_busy(report(4, 4), site_in_flight=0, batch_in_flight=0) == 8
    # This gateway's own chat there, not yet in a report, counts; its batch items do not.
    assert interactive_busy(site, site_in_flight=9, batch_in_flight=4) == 5
    assert interactive_busy(None, site_in_flight=3, batch_in_flight=3) == 0


def test_urgency_promotes_a_batch_near_its_deadline() -> None:
    window = timedelta(hours=24)
    now = T0 + timedelta(hours=12)
    assert urgency(None, T0, now, 0.25) == (1, float("inf"))
    relaxed = urgency(T0 + window, T0, now, 0.25)
    assert relaxed[0] == 1
    near = urgency(T0 + window, T0, T0 + timedelta(hours=20), 0.25)
    assert near[0] == 0
    # Half the window left, but the estimate says it needs more than that.
    late = urgency(T0 + window, T0, now, 0.25, eta_s=13 * 3600)
    assert late[0] == 0
    assert near < relaxed


def test_a_feed_holds_no_more_than_its_room_and_serves_urgent_first() -> None:
    room = {"n": 2}
    feed = SiteFeed(lambda in_flight: room["n"])
    started: list[str] = []
    peak = 0

    async def item(name: str, priority: tuple[int, float], hold: asyncio.Event) -> None:
        nonlocal peak
        async with feed.place(priority):
            started.append(name)
            peak = max(peak, feed.in_flight)
            await hold.wait()

    async def scenario() -> None:
        first, later = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(item(f"a{i}", (1, 9.0), first)) for i in range(2)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(item(f"b{i}", (1, 5.0), later)) for i in range(2)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(item("urgent", (0, 7.0), later)))
        await asyncio.sleep(0.01)
        assert started == ["a0", "a1"]  # the room is full: the rest wait in the database's stead
        first.set()
        await asyncio.sleep(0.01)
        assert started[2:] == ["urgent", "b0"]
        # The site reports more idle capacity: the waiter is granted without a release.
        room["n"] = 3
        await asyncio.sleep(0.7)
        assert started[4:] == ["b1"]
        later.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert peak == 3
    assert feed.in_flight == 0


def test_a_cancelled_waiter_gives_its_place_on() -> None:
    feed = SiteFeed(lambda in_flight: 1)

    async def scenario() -> None:
        hold = asyncio.Event()

        async def holder() -> None:
            async with feed.place((1, 0.0)):
                await hold.wait()

        async def waiter() -> None:
            async with feed.place((1, 0.0)):
                pass

        first = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        hold.set()
        await first
        await asyncio.wait_for(waiter(), 1.0)  # the cancelled waiter holds nothing

    asyncio.run(scenario())
    assert feed.in_flight == 0


def test_progress_and_eta_from_planned_tokens() -> None:
    start = T0
    half = estimate(1000, 250, start, start + timedelta(seconds=10))
    assert (half.fraction, half.eta_s) == (0.25, 30.0)
    assert estimate(1000, 0, start, start + timedelta(seconds=10)).eta_s is None
    assert estimate(1000, 1000, start, start + timedelta(seconds=10)).eta_s is None
    assert estimate(1000, 500, None, start).eta_s is None
    assert estimate(0, 0, start, start).fraction == 1.0
