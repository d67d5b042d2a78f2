"""The batch store and leases against real databases: batches and items written whole, pages,
item moves fenced by attempts, counters and settling, cancel, and leases between gateways."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from functools import partial

import pytest
from sqlalchemy import select

from gateway.batches.finalize import BatchFinalizer
from gateway.batches.leases import BatchLeases
from gateway.batches.output import render
from gateway.batches.records import (
    BatchView,
    ItemAssignment,
    ItemResult,
    NewBatch,
    NewItem,
    TokenUsage,
)
from gateway.batches.settling import CANCELLED_ERROR
from gateway.batches.store import BatchStore
from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import (
    BatchItemStatus,
    BatchStatus,
    InferenceRequest,
    RequestStatus,
    utcnow,
)
from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import SiteConfig
from gateway.stores.request_log import NewRequest, Outcome, RequestLog
from gateway.stores.site_store import sync_sites

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]
SITES = (
    SiteConfig("a", "aws", "us-east-1", "127.0.0.1:1", "m"),
    SiteConfig("b", "gcp", "europe-west4", "127.0.0.1:2", "m"),
)
DONE = ItemResult(BatchItemStatus.COMPLETED, completion={"id": "cmpl-1"})
BROKEN = ItemResult(BatchItemStatus.FAILED, error={"message": "boom", "type": "server_error"})
CANCELLED = ItemResult(BatchItemStatus.CANCELLED)

Scenario = Callable[[BatchStore, BatchLeases, dict[str, int], BatchFinalizer], Awaitable[None]]


@pytest.fixture(params=DATABASES)
def run(request) -> Iterator[Callable[[Scenario], None]]:
    url = request.getfixturevalue(request.param)
    upgrade(url)

    async def go(scenario: Scenario) -> None:
        engine = create_engine(url)
        try:
            sessions = create_sessionmaker(engine)
            sites = await sync_sites(sessions, SITES)
            await scenario(
                BatchStore(sessions), BatchLeases(sessions), sites, BatchFinalizer(sessions)
            )
        finally:
            await engine.dispose()

    try:
        yield lambda scenario: asyncio.run(go(scenario))
    finally:
        downgrade(url)


def new_items(count: int) -> list[NewItem]:
    return [NewItem(f"c{i}", json.dumps({"prompt": f"p{i}"}), 3, 10 + i) for i in range(count)]


def new_batch(batch_id: str, owner: int | None = None, **extra: object) -> NewBatch:
    fields: dict[str, object] = {"metadata": {"k": "v"}, **extra}
    return NewBatch(batch_id, owner, "m", "/v1/completions", **fields)  # type: ignore[arg-type]


async def finalize(fin: BatchFinalizer, batch_id: str) -> BatchView | None:
    return await fin.finalize(
        batch_id,
        partial(render, batch_id),
        utcnow() + timedelta(hours=1),
        lambda: f"file-{uuid.uuid4().hex}",
    )


async def in_progress(store: BatchStore, batch_id: str, count: int, site_id: int) -> None:
    await store.create(new_batch(batch_id), new_items(count))
    await store.assign(
        batch_id, [ItemAssignment(i, site_id, 5, 1, "v1", "why") for i in range(count)]
    )
    assert await store.begin_progress(batch_id)


def test_batches_and_results_page(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        for i in range(3):
            created = await store.create(new_batch(f"batch_{i}"), new_items(5))
            assert created is not None
            assert (created.status, created.total, created.completed) == (
                BatchStatus.VALIDATING,
                5,
                0,
            )
        first = await store.list_batches(None, None, 2)
        assert first is not None
        assert ([b.id for b in first.data], first.has_more) == (["batch_2", "batch_1"], True)
        rest = await store.list_batches(None, "batch_1", 2)
        assert rest is not None
        assert ([b.id for b in rest.data], rest.has_more) == (["batch_0"], False)
        assert await store.list_batches(None, "batch_nope", 2) is None
        assert await store.get("batch_nope", None) is None

        await store.assign(
            "batch_0", [ItemAssignment(i, sites["b"], 7, 2, "v1", f"r{i}") for i in range(5)]
        )
        page = await store.results("batch_0", "c1", 2)
        assert page is not None
        assert [(r.custom_id, r.site, r.predicted_tokens, r.assign_reason) for r in page.data] == [
            ("c2", "b", 7, "r2"),
            ("c3", "b", 7, "r3"),
        ]
        assert page.has_more
        assert await store.results("batch_0", "c9", 2) is None

    run(scenario)


def test_items_move_once_and_settle_the_batch(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        await in_progress(store, "batch_x", 3, sites["a"])
        assert await store.lanes("batch_x") == [sites["a"]]
        lane = await store.lane("batch_x", sites["a"], None, 10)
        assert [(q.index, q.predicted_tokens, q.attempts) for q in lane] == [
            (0, 5, 0),
            (1, 5, 0),
            (2, 5, 0),
        ]
        assert await store.lane("batch_x", None, None, 10) == []

        assert await store.start_item("batch_x", 0, 0, "cmpl-a")
        assert not await store.start_item("batch_x", 0, 0, "cmpl-b")  # started already
        assert await store.start_item("batch_x", 0, 1, "cmpl-c")  # a retry: start number 2
        assert not await store.finish_item("batch_x", 0, 1, DONE)  # stale attempt: refused
        assert await store.finish_item("batch_x", 0, 2, DONE)
        assert not await store.finish_item("batch_x", 0, 2, BROKEN)  # final stays final
        assert not await store.start_item("batch_x", 0, 2, "cmpl-d")

        assert await store.start_item("batch_x", 1, 0, "cmpl-e")
        assert await store.finish_item("batch_x", 1, 1, BROKEN)
        mid = await store.get("batch_x", None)
        assert mid is not None
        assert (mid.status, mid.completed, mid.failed) == (BatchStatus.IN_PROGRESS, 1, 1)

        # An item that no longer validates fails without a start.
        assert not await store.finish_item("batch_x", 2, 0, BROKEN)  # it is not running
        assert await store.finish_item("batch_x", 2, 0, BROKEN, started=False)
        ending = await store.get("batch_x", None)
        assert ending is not None
        assert (ending.status, ending.completed, ending.failed) == (BatchStatus.FINALIZING, 1, 2)
        assert (ending.finalizing_at is not None, ending.finished_at) == (True, None)
        done = await finalize(fin, "batch_x")
        assert done is not None
        assert (done.status, done.completed, done.failed) == (BatchStatus.COMPLETED, 1, 2)
        assert done.finished_at is not None
        assert done.output_file_id is not None
        assert done.error_file_id is not None
        assert await finalize(fin, "batch_x") is None  # settled: written once
        page = await store.results("batch_x", None, 10)
        assert page is not None
        first = page.data[0]
        assert (first.status, first.attempts, first.request_id) == (
            BatchItemStatus.COMPLETED,
            2,
            "cmpl-c",
        )
        assert first.completion == {"id": "cmpl-1"}
        assert page.data[1].error == BROKEN.error

    run(scenario)


def test_all_failed_is_a_failed_batch(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        await in_progress(store, "batch_f", 2, sites["a"])
        for index in range(2):
            assert await store.finish_item("batch_f", index, 0, BROKEN, started=False)
        batch = await finalize(fin, "batch_f")
        assert batch is not None
        assert (batch.status, batch.output_file_id) == (BatchStatus.FAILED, None)

    run(scenario)


def test_cancel(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        await in_progress(store, "batch_c", 3, sites["a"])
        assert await store.start_item("batch_c", 0, 0, "cmpl-a")
        cancelling = await store.cancel("batch_c", None)
        assert cancelling is not None
        assert (cancelling.status, cancelling.cancelled) == (BatchStatus.CANCELLING, 2)
        assert cancelling.cancelling_at is not None
        assert not await store.start_item("batch_c", 1, 0, "cmpl-b")
        page = await store.results("batch_c", "c0", 1)
        assert page is not None
        assert (page.data[0].status, page.data[0].error) == (
            BatchItemStatus.CANCELLED,
            CANCELLED_ERROR,
        )
        assert await store.lanes("batch_c") == []
        assert await store.finish_item("batch_c", 0, 1, CANCELLED)
        assert await store.cancel("batch_c", None) is not None  # still cancelling: files next
        cancelled = await finalize(fin, "batch_c")
        assert cancelled is not None
        assert (cancelled.status, cancelled.cancelled) == (BatchStatus.CANCELLED, 3)
        again = await store.cancel("batch_c", None)
        assert again is not None
        assert again.status == BatchStatus.CANCELLED

        # Nothing running: cancelled at once, even while still being assigned.
        await store.create(new_batch("batch_v"), new_items(2))
        now = await store.cancel("batch_v", None)
        assert now is not None
        assert (now.status, now.cancelled, now.finalizing_at is not None) == (
            BatchStatus.CANCELLING,
            2,
            True,
        )
        settled = await finalize(fin, "batch_v")
        assert settled is not None
        assert settled.status == BatchStatus.CANCELLED
        assert not await store.begin_progress("batch_v")
        assert await store.cancel("batch_nope", None) is None

    run(scenario)


def test_leases_and_recovery(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        await in_progress(store, "batch_1", 2, sites["a"])
        await in_progress(store, "batch_2", 2, sites["b"])
        assert sorted(await leases.claim("gw-a", 60, 10)) == ["batch_1", "batch_2"]
        assert await leases.claim("gw-b", 60, 10) == []
        assert await leases.renew("gw-a", ["batch_1", "batch_2"], 60) == {
            "batch_1": BatchStatus.IN_PROGRESS,
            "batch_2": BatchStatus.IN_PROGRESS,
        }
        assert await leases.renew("gw-b", ["batch_1"], 60) == {}

        # gw-a stops and hands batch_1 back; its running item runs again under gw-b.
        assert await store.start_item("batch_1", 0, 0, "cmpl-a")
        await leases.release("gw-a", ["batch_1"])
        assert await leases.claim("gw-b", 60, 10) == ["batch_1"]
        recovered = await leases.recover("batch_1")
        assert recovered is not None
        lane = await store.lane("batch_1", sites["a"], None, 10)
        assert [(q.index, q.attempts) for q in lane] == [(0, 1), (1, 0)]
        assert not await store.finish_item("batch_1", 0, 1, DONE)  # gw-a's late result

        # gw-a dies holding batch_2 with a lease that has lapsed; a cancel came meanwhile.
        assert await leases.renew("gw-a", ["batch_2"], -1) == {"batch_2": BatchStatus.IN_PROGRESS}
        assert await store.start_item("batch_2", 0, 0, "cmpl-b")
        await store.cancel("batch_2", None)
        assert await leases.claim("gw-b", 60, 10) == ["batch_2"]
        recovered = await leases.recover("batch_2")
        assert recovered is not None
        assert (recovered.status, recovered.cancelled) == (BatchStatus.CANCELLING, 2)
        settled = await finalize(fin, "batch_2")
        assert settled is not None
        assert settled.status == BatchStatus.CANCELLED
        assert await leases.renew("gw-b", ["batch_2"], 60) == {}

    run(scenario)


def test_concurrent_finishes_count_exactly(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        count = 40
        await in_progress(store, "batch_n", count, sites["a"])
        for index in range(count):
            assert await store.start_item("batch_n", index, 0, f"cmpl-{index}")
        results = [DONE if index % 4 else BROKEN for index in range(count)]
        written = await asyncio.gather(
            *(store.finish_item("batch_n", i, 1, result) for i, result in enumerate(results))
        )
        assert all(written)
        batch = await store.get("batch_n", None)
        assert batch is not None
        assert (batch.status, batch.completed, batch.failed) == (BatchStatus.FINALIZING, 30, 10)

    run(scenario)


def answered(prompt: int, completion: int, cached: int | None) -> ItemResult:
    usage: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return ItemResult(BatchItemStatus.COMPLETED, completion={"usage": usage})


def test_usage_sums_the_answered_items_cached_tokens_too(run) -> None:
    """A batch's usage is its answered items' usage summed, the prompt tokens the sites took
    from their caches included (an answer stored without the details counts none)."""

    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        await in_progress(store, "batch_u", 4, sites["a"])
        await in_progress(store, "batch_v", 1, sites["a"])
        results = [answered(40, 5, 16), answered(41, 6, 32), BROKEN, answered(42, 7, None)]
        for index, result in enumerate(results):
            assert await store.start_item("batch_u", index, 0, f"cmpl-u{index}")
            assert await store.finish_item("batch_u", index, 1, result)
        usage = await store.usage(["batch_u", "batch_v", "batch_none"])
        assert usage == {"batch_u": TokenUsage(123, 18, 48)}

    run(scenario)


def test_planned_work_counts_prompt_and_planned_answer_of_final_items(run) -> None:
    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        items = [NewItem(f"c{i}", json.dumps({"prompt": "p"}), 10, 100) for i in range(3)]
        await store.create(new_batch("batch_w"), items)
        # Planned: 10 + 20 (predicted), 10 + 100 (max_tokens, no prediction), 10 + 5.
        await store.assign(
            "batch_w",
            [
                ItemAssignment(i, sites["a"], p, None, None, "why")
                for i, p in enumerate([20, None, 5])
            ],
        )
        assert await store.planned_work(["batch_w"]) == {"batch_w": (155, 0)}
        assert await store.start_item("batch_w", 1, 0, "cmpl-w1")
        assert await store.finish_item("batch_w", 1, 1, DONE)
        assert await store.planned_work(["batch_w", "batch_none"]) == {"batch_w": (155, 110)}

    run(scenario)


def test_a_lane_reads_the_plan_order_page_by_page(run) -> None:
    """The store keeps the order the batch plan made (plan_rank) and reads it back, a page at
    a time; ties in rank go in submission order, and items not yet planned keep theirs."""

    async def scenario(
        store: BatchStore, leases: BatchLeases, sites: dict[str, int], fin: BatchFinalizer
    ) -> None:
        items = [NewItem(f"c{i}", json.dumps({"prompt": "p"}), 3, 50 + i) for i in range(6)]
        await store.create(new_batch("batch_l"), items)
        await store.assign(
            "batch_l",
            [ItemAssignment(i, None, None, None, None, "why") for i in range(6)],
        )
        assert [q.index for q in await store.lane("batch_l", None, None, 10)] == list(range(6))
        ranks = [4, 2, 0, 2, 9, 1]
        await store.assign(
            "batch_l",
            [ItemAssignment(i, sites["a"], 5, None, None, "why", r) for i, r in enumerate(ranks)],
        )
        whole = await store.lane("batch_l", sites["a"], None, 10)
        assert [q.index for q in whole] == [2, 5, 1, 3, 0, 4]
        # One, then two at a time from each page's last key: the tie at rank 2 is split.
        seen: list[int] = []
        after = None
        while page := await store.lane("batch_l", sites["a"], after, 1 if not seen else 2):
            seen += [q.index for q in page]
            after = page[-1].lane_key()
        assert seen == [2, 5, 1, 3, 0, 4]

    run(scenario)


@pytest.mark.parametrize("database", DATABASES)
def test_a_final_item_settles_its_request_row_in_the_same_transaction(
    database: str, request: pytest.FixtureRequest
) -> None:
    """The request log writes an item's full outcome behind, in batches; the item's own final
    write already gives its row the final status (a gateway stopped in between left it
    `dispatched`), and leaves a row the request log finalized first as it is."""
    url = request.getfixturevalue(database)
    upgrade(url)
    answer = ItemResult(
        BatchItemStatus.COMPLETED,
        completion={"usage": {"completion_tokens": 9}, "choices": [{"finish_reason": "length"}]},
    )

    async def scenario() -> dict[str, tuple[object, ...]]:
        engine = create_engine(url)
        try:
            sessions = create_sessionmaker(engine)
            sites = await sync_sites(sessions, SITES)
            store, log = BatchStore(sessions), RequestLog(sessions)
            await in_progress(store, "batch_r", 3, sites["a"])
            for index in range(3):
                assert await store.start_item("batch_r", index, 0, f"cmpl-r{index}")
                rid = f"cmpl-r{index}"
                new = NewRequest(rid, "batch", "m", False, None, 3, 16, "b", sites["a"])
                await log.accepted(new)
            outcome = Outcome(RequestStatus.COMPLETED, sites["a"], 1, 7, "stop")
            await log.finished("cmpl-r2", outcome)  # the request log was first for this one
            assert await store.finish_item("batch_r", 0, 1, answer)
            assert await store.finish_item("batch_r", 1, 1, BROKEN)
            assert await store.finish_item("batch_r", 2, 1, answer)
            async with sessions() as session:
                rows = (await session.execute(select(InferenceRequest))).scalars()
                return {
                    r.id: (r.status, r.completion_tokens, r.finish_reason, r.error,
                           r.finished_at is not None)
                    for r in rows
                }  # fmt: skip
        finally:
            await engine.dispose()

    try:
        rows = asyncio.run(scenario())
    finally:
        downgrade(url)
    assert rows == {
        "cmpl-r0": (RequestStatus.COMPLETED, 9, "length", None, True),
        "cmpl-r1": (RequestStatus.FAILED, None, None, "boom", True),
        "cmpl-r2": (RequestStatus.COMPLETED, 7, "stop", None, True),
    }
