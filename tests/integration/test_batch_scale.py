"""A large batch is written, cancelled and given its error file without holding the event loop
(issue 58: "a 90,000-item batch takes 117 s to create, and cancelling it stalls the gateway
~1 s"), on PostgreSQL.

The loop is judged by the CPU time it spends between two turns of a ticker task (the longest
stretch in which nothing else could run), not by wall-clock lag: on a loaded 2-core host a
turn waits for the CPU as long as the load makes it, whatever the code does, while the CPU time
of one stretch is the code's own. Measured here at 20,000 items: the bulk write's longest
stretch 16-20 ms (SQLAlchemy compiling the batch's first statements; the COPY's chunks take ~3
ms), cancelling and writing the error file 9-10 ms; before issue 58's fix the finalizer
loaded each page of items as ORM objects with their request bodies, 31-55 ms at a stretch.
Issue 67 (CI at load 6-9 failed every run, 33-72 ms): the ORM's mappers were configured on the
first model object, within the write (35-72 ms; now as the session factory is made, before
serving), and the finalizer's pages of 1,000 rows took 27-34 ms each (250 now: 5-9 ms at
load ~10).
"""

from __future__ import annotations

import asyncio
import gc
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from functools import partial

import pytest

from gateway.batches.finalize import BatchFinalizer
from gateway.batches.output import render
from gateway.batches.records import NewBatch, NewItem
from gateway.batches.store import BatchStore
from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import BatchItemStatus, BatchStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from tests.loop_held import slowness, ticking

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
ITEMS = 20_000
# The longest the loop may run between two turns of the ticker, in CPU seconds on the machine
# tests/loop_held.py's reference work was timed on (scaled by its slowness() elsewhere): above
# what this code measured (20 ms at most), below the old finalizer's pages (31-55 ms).
MOST_HELD_S = 0.025
Scenario = Callable[[BatchStore, BatchFinalizer], Awaitable[None]]


@pytest.fixture
def run(postgres_url: str) -> Iterator[Callable[[Scenario], None]]:
    upgrade(postgres_url)
    # As a gateway runs (gateway/__main__.py): what was imported before serving is out of the
    # collector's sight; else a full collection would walk pytest's whole heap, whatever the
    # code under test does.
    gc.collect()
    gc.freeze()

    async def go(scenario: Scenario) -> None:
        engine = create_engine(postgres_url)
        try:
            sessions = create_sessionmaker(engine)
            await scenario(BatchStore(sessions), BatchFinalizer(sessions))
        finally:
            await engine.dispose()

    try:
        yield lambda scenario: asyncio.run(go(scenario))
    finally:
        gc.unfreeze()
        downgrade(postgres_url)


def chat_items(count: int) -> list[NewItem]:
    """Items as a chat batch's are stored: a system and a user message each."""
    return [
        NewItem(
            f"req-{i}",
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Answer in one word."},
                        {"role": "user", "content": f"Item {i}: say hello, ünïcode"},
                    ],
                    "max_tokens": 4,
                }
            ),
            12,
            4,
        )
        for i in range(count)
    ]


def test_a_large_batch_is_written_cancelled_and_finalized_without_holding_the_loop(run) -> None:
    async def scenario(store: BatchStore, finalizer: BatchFinalizer) -> None:
        batch_id = f"batch_{uuid.uuid4().hex}"
        items = chat_items(ITEMS)
        new = NewBatch(batch_id, None, "tiny", "/v1/chat/completions", None)
        async with ticking() as creating:
            batch = await store.create(new, items)
        assert batch is not None
        assert batch.total == ITEMS
        # Written in order, each body whole.
        queued = await store.queued(batch_id, -1, 3)
        assert [(q.index, q.custom_id) for q in queued] == [
            (0, "req-0"),
            (1, "req-1"),
            (2, "req-2"),
        ]
        assert queued[1].body == json.loads(items[1].body)
        assert (queued[1].prompt_tokens, queued[1].max_tokens, queued[1].attempts) == (12, 4, 0)
        async with ticking() as cancelling:
            cancelled = await store.cancel(batch_id, None)
            assert cancelled is not None
            assert cancelled.cancelled == ITEMS
            settled = await finalizer.finalize(
                batch_id,
                partial(render, batch_id),
                utcnow() + timedelta(hours=1),
                lambda: f"file-{uuid.uuid4().hex}",
            )
        assert settled is not None
        assert settled.status == BatchStatus.CANCELLED
        assert (settled.error_file_id is None, settled.output_file_id) == (False, None)
        page = await store.results(batch_id, None, 1000)
        assert page is not None
        assert page.has_more
        first = page.data[0]
        assert (first.index, first.custom_id, first.status) == (
            0,
            "req-0",
            BatchItemStatus.CANCELLED,
        )
        assert [item.index for item in page.data] == list(range(1000))
        for label, held in (("written", creating), ("cancelled and finalized", cancelling)):
            assert held.turns > 20, (label, held)  # the ticker had turns throughout
            assert held.most_s < MOST_HELD_S * slowness(), (
                f"the loop ran {held.most_s * 1000:.0f} ms of CPU at a stretch while a "
                f"{ITEMS}-item batch was {label} (bound {MOST_HELD_S * 1000:.0f} ms x "
                f"{slowness():.2f}, this machine's slowness)"
            )

    run(scenario)
