"""Files and batch results against real databases: files written whole in parts and read back,
scoped to their key, bounded by its quota and deleted once expired; a batch's output and error
files in OpenAI's line format, written once; batches scoped to their key, stopped when their
key is revoked or their window passes, and never made from a file deleted meanwhile."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batches.finalize import BatchFinalizer
from gateway.batches.leases import BatchLeases
from gateway.batches.output import render
from gateway.batches.records import BatchView, ItemResult, NewBatch, NewItem
from gateway.batches.settling import EXPIRED_ERROR
from gateway.batches.store import BatchStore
from gateway.db.migrate import downgrade, upgrade
from gateway.db.models import BatchItemStatus, BatchStatus, utcnow
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.file_store import PART_BYTES, FileStore, NewFile, QuotaExceeded
from gateway.tenancy.keys import KeyService

DATABASES = ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)]


@dataclass
class Db:
    sessions: async_sessionmaker[AsyncSession]
    files: FileStore
    batches: BatchStore
    leases: BatchLeases
    finalizer: BatchFinalizer
    alice: int
    bob: int


@pytest.fixture(params=DATABASES)
def run(request) -> Iterator[Callable[[Callable[[Db], Awaitable[None]]], None]]:
    url = request.getfixturevalue(request.param)
    upgrade(url)

    async def go(scenario: Callable[[Db], Awaitable[None]]) -> None:
        engine = create_engine(url)
        try:
            sessions = create_sessionmaker(engine)
            keys = KeyService(sessions)
            alice = (await keys.create("alice", None, None)).record.id
            bob = (await keys.create("bob", None, None)).record.id
            await scenario(
                Db(
                    sessions,
                    FileStore(sessions),
                    BatchStore(sessions),
                    BatchLeases(sessions),
                    BatchFinalizer(sessions),
                    alice,
                    bob,
                )
            )
        finally:
            await engine.dispose()

    try:
        yield lambda scenario: asyncio.run(go(scenario))
    finally:
        downgrade(url)


def new_file(owner: int | None, expires_in_s: float = 3600) -> NewFile:
    expires = utcnow() + timedelta(seconds=expires_in_s)
    return NewFile(f"file-{uuid.uuid4().hex}", owner, "batch", "in.jsonl", expires)


async def finalize(db: Db, batch_id: str) -> BatchView | None:
    return await db.finalizer.finalize(
        batch_id,
        partial(render, batch_id),
        utcnow() + timedelta(hours=1),
        lambda: f"file-{uuid.uuid4().hex}",
    )


def items(count: int) -> list[NewItem]:
    return [NewItem(f"c{i}", json.dumps({"prompt": f"p{i}"}), 3, 10) for i in range(count)]


def test_files_are_stored_in_parts_scoped_bounded_and_expire(run) -> None:
    async def scenario(db: Db) -> None:
        big = bytes(range(256)) * (PART_BYTES // 128 + 3)  # a little over two parts
        stored = await db.files.create(new_file(db.alice), big, quota=None)
        assert stored.bytes == len(big)
        assert await db.files.content(stored.id, db.alice) == big
        parts = await db.files.parts(stored.id, db.alice)
        assert parts is not None
        assert [len(p) async for p in parts] == [PART_BYTES, PART_BYTES, len(big) - 2 * PART_BYTES]

        # Another key (or no key) cannot see, read, list or delete it.
        for other in (db.bob, None):
            assert await db.files.get(stored.id, other) is None
            assert await db.files.content(stored.id, other) is None
            assert not await db.files.delete(stored.id, other)
            listed = await db.files.list_files(other, None, 10, "desc", None)
            assert listed is not None
            assert listed.data == []

        # The quota counts the key's live uploads; a refused upload writes nothing.
        small = [await db.files.create(new_file(db.alice), b"x" * 10, quota=None) for _ in range(3)]
        with pytest.raises(QuotaExceeded) as refused:
            await db.files.create(new_file(db.alice), b"y" * 10, quota=len(big) + 35)
        assert refused.value.stored == len(big) + 30
        await db.files.create(new_file(db.bob), b"y" * 10, quota=len(big) + 35)  # bob's own

        newest = await db.files.list_files(db.alice, None, 2, "desc", None)
        assert newest is not None
        assert ([f.id for f in newest.data], newest.has_more) == ([small[2].id, small[1].id], True)
        rest = await db.files.list_files(db.alice, small[1].id, 10, "desc", "batch")
        assert rest is not None
        assert [f.id for f in rest.data] == [small[0].id, stored.id]
        oldest = await db.files.list_files(db.alice, None, 1, "asc", None)
        assert oldest is not None
        assert [f.id for f in oldest.data] == [stored.id]
        assert await db.files.list_files(db.alice, "file-nope", 10, "asc", None) is None
        none = await db.files.list_files(db.alice, None, 10, "asc", "batch_output")
        assert none is not None
        assert none.data == []

        assert await db.files.delete(stored.id, db.alice)
        assert await db.files.get(stored.id, db.alice) is None
        assert not await db.files.delete(stored.id, db.alice)

        # An expired file is gone for its owner at once, and from the database at the sweep.
        lapsed = await db.files.create(new_file(db.alice, expires_in_s=-1), b"z", quota=None)
        assert await db.files.get(lapsed.id, db.alice) is None
        assert await db.files.delete_expired() == 1

    run(scenario)


def test_result_files_in_openai_line_format_written_once(run) -> None:
    async def scenario(db: Db) -> None:
        store = db.batches
        await store.create(NewBatch("batch_r", db.alice, "m", "/v1/completions", None), items(3))
        assert await store.begin_progress("batch_r")
        completion: dict[str, object] = {"id": "cmpl-a", "object": "text_completion", "choices": []}
        failure: dict[str, object] = {
            "message": "no site",
            "type": "server_error",
            "code": "service_unavailable",
        }
        assert await store.start_item("batch_r", 0, 0, "cmpl-a")
        assert await store.finish_item(
            "batch_r", 0, 1, ItemResult(BatchItemStatus.COMPLETED, completion=completion)
        )
        assert await store.start_item("batch_r", 1, 0, "cmpl-b")
        assert await store.finish_item(
            "batch_r", 1, 1, ItemResult(BatchItemStatus.FAILED, error=failure, status_code=503)
        )
        await store.expire("batch_r")  # item 2 never started
        racing = await asyncio.gather(finalize(db, "batch_r"), finalize(db, "batch_r"))
        done = [view for view in racing if view is not None]
        assert len(done) == 1  # two gateways that both believe they hold it: one writes
        batch = done[0]
        assert (batch.status, batch.completed, batch.failed) == (BatchStatus.EXPIRED, 1, 1)
        assert batch.output_file_id is not None
        assert batch.error_file_id is not None

        output = await db.files.get(batch.output_file_id, db.alice)
        assert output is not None
        assert (output.purpose, output.filename) == ("batch_output", "batch_r_output.jsonl")
        assert await db.files.get(batch.output_file_id, db.bob) is None  # the batch's key only
        out = await db.files.content(batch.output_file_id, db.alice)
        errors = await db.files.content(batch.error_file_id, db.alice)
        assert out is not None
        assert errors is not None
        (answered,) = [json.loads(line) for line in out.splitlines()]
        assert answered["id"].startswith("batch_req_")
        assert {k: v for k, v in answered.items() if k != "id"} == {
            "custom_id": "c0",
            "response": {"status_code": 200, "request_id": "cmpl-a", "body": completion},
            "error": None,
        }
        failed, expired = [json.loads(line) for line in errors.splitlines()]
        assert failed["response"] == {
            "status_code": 503,
            "request_id": "cmpl-b",
            "body": {"error": failure},
        }
        assert (failed["custom_id"], failed["error"]) == ("c1", None)
        assert (expired["custom_id"], expired["response"]) == ("c2", None)
        assert expired["error"] == {
            "code": "batch_expired",
            "message": EXPIRED_ERROR["message"],
        }

    run(scenario)


def test_batches_are_their_keys_own(run) -> None:
    async def scenario(db: Db) -> None:
        store = db.batches
        await store.create(NewBatch("batch_a", db.alice, "m", "/v1/completions", None), items(2))
        await store.create(NewBatch("batch_n", None, "m", "/v1/completions", None), items(1))
        for other in (db.bob, None):
            assert await store.get("batch_a", other) is None
            assert await store.cancel("batch_a", other) is None
            page = await store.list_batches(other, None, 10)
            assert page is not None
            assert "batch_a" not in [b.id for b in page.data]
        mine = await store.list_batches(db.alice, None, 10)
        assert mine is not None
        assert [b.id for b in mine.data] == ["batch_a"]
        assert await store.list_batches(db.bob, "batch_a", 10) is None  # not a cursor of bob's
        unchanged = await store.get("batch_a", db.alice)
        assert unchanged is not None
        assert unchanged.status == BatchStatus.VALIDATING

    run(scenario)


def test_no_batch_from_a_file_deleted_meanwhile(run) -> None:
    async def scenario(db: Db) -> None:
        upload = await db.files.create(new_file(db.alice), b"{}", quota=None)
        new = NewBatch("batch_f", db.alice, "m", "/v1/completions", None, upload.id, "24h")
        assert await db.files.delete(upload.id, db.alice)
        assert await db.batches.create(new, items(2)) is None
        assert await db.batches.get("batch_f", db.alice) is None
        # Another key's file is no input either.
        theirs = await db.files.create(new_file(db.bob), b"{}", quota=None)
        stolen = NewBatch("batch_s", db.alice, "m", "/v1/completions", None, theirs.id, "24h")
        assert await db.batches.create(stolen, items(1)) is None

    run(scenario)


def test_a_revoked_keys_batches_stop_and_late_windows_expire(run) -> None:
    async def scenario(db: Db) -> None:
        store, leases = db.batches, db.leases
        await store.create(NewBatch("batch_k", db.alice, "m", "/v1/completions", None), items(2))
        await store.create(NewBatch("batch_b", db.bob, "m", "/v1/completions", None), items(2))
        assert await store.cancel_owned_by(db.alice) == ["batch_k"]
        cancelled = await store.get("batch_k", db.alice)
        assert cancelled is not None
        assert (cancelled.status, cancelled.cancelled) == (BatchStatus.CANCELLING, 2)
        untouched = await store.get("batch_b", db.bob)
        assert untouched is not None
        assert untouched.status == BatchStatus.VALIDATING

        # Revoked while no gateway held its batch: the next to claim it cancels it.
        await KeyService(db.sessions).revoke(db.bob)
        recovered = await leases.recover("batch_b")
        assert recovered is not None
        assert (recovered.status, recovered.cancelled) == (BatchStatus.CANCELLING, 2)

        # A window that passed while no gateway held the batch: expired when claimed.
        late = NewBatch(
            "batch_l",
            db.alice,
            "m",
            "/v1/completions",
            None,
            None,
            "1h",
            utcnow() - timedelta(seconds=1),
        )
        await store.create(late, items(2))
        expired = await leases.recover("batch_l")
        assert expired is not None
        assert (expired.status, expired.cancelled) == (BatchStatus.FINALIZING, 2)
        assert expired.expired_at is not None
        settled = await finalize(db, "batch_l")
        assert settled is not None
        assert settled.status == BatchStatus.EXPIRED

        # A window that passes once every item is final changes nothing: it completed.
        await store.create(NewBatch("batch_d", db.alice, "m", "/v1/completions", None), items(1))
        assert await store.begin_progress("batch_d")
        assert await store.finish_item(
            "batch_d", 0, 0, ItemResult(BatchItemStatus.COMPLETED, completion={}), started=False
        )
        await store.expire("batch_d")
        done = await finalize(db, "batch_d")
        assert done is not None
        assert (done.status, done.expired_at) == (BatchStatus.COMPLETED, None)

    run(scenario)
