"""Files of the Files API in the database: metadata in `files`, bytes in `file_parts` (1 MiB
each, in order), every query scoped to the key that owns the file.

The database rather than a directory or an object store: every gateway replica already shares
it (a batch created through one gateway is run and finalized by whichever holds its lease, and
its files are read through any), it is backed up with the batches that refer to the files, and
a file is written in the same transaction as the batch or result it belongs to, so nothing is
ever half-created. Files are bounded (GATEWAY_FILE_MAX_BYTES, GATEWAY_FILE_STORAGE_PER_KEY_BYTES)
and deleted once they expire (GATEWAY_FILE_RETENTION_H).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import and_, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.sql.elements import ColumnElement

from gateway.db.models import ApiKey, FilePart, StoredFile, utcnow
from gateway.db.session import SessionStore
from gateway.stores.pages import Owner, Page

PART_BYTES = 1 << 20
# Uploads count against their key's storage; the batches' result files do not (the gateway
# writes them, and must never fail a finished batch over a quota). Batch input files, and the
# training data of fine-tuning jobs (gateway/fine_tuning/).
UPLOAD_PURPOSE = "batch"
FINE_TUNE_PURPOSE = "fine-tune"
UPLOAD_PURPOSES = (UPLOAD_PURPOSE, FINE_TUNE_PURPOSE)
Order = Literal["asc", "desc"]


def owned_by(column: InstrumentedAttribute[int | None], owner: Owner) -> ColumnElement[bool]:
    """The rows of `owner`: a key's own, or those made without a key when `owner` is None."""
    return column.is_(None) if owner is None else column == owner


@dataclass(frozen=True, slots=True)
class NewFile:
    id: str
    owner: Owner
    purpose: str
    filename: str
    expires_at: datetime | None
    batch_id: str | None = None


@dataclass(frozen=True, slots=True)
class FileView:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None


def _view(row: StoredFile) -> FileView:
    return FileView(row.id, row.purpose, row.filename, row.bytes, row.created_at, row.expires_at)


def _live() -> ColumnElement[bool]:
    return or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > utcnow())


class FileWriter:
    """Writes one file into an open transaction, a part at a time as its bytes come (SQL
    statements only: the caller may clear its session between writes)."""

    def __init__(self, session: AsyncSession, new: NewFile, created_at: datetime) -> None:
        self._session = session
        self._new = new
        self._created_at = created_at
        self._buffer = bytearray()
        self._seq = 0
        self._size = 0

    @classmethod
    async def open(cls, session: AsyncSession, new: NewFile) -> FileWriter:
        writer = cls(session, new, utcnow())
        # The row before its parts, whose foreign key names it.
        await session.execute(
            insert(StoredFile).values(
                id=new.id,
                api_key_id=new.owner,
                purpose=new.purpose,
                filename=new.filename,
                bytes=0,
                created_at=writer._created_at,
                expires_at=new.expires_at,
                batch_id=new.batch_id,
            )
        )
        return writer

    async def write(self, data: bytes) -> None:
        self._buffer += data
        self._size += len(data)
        while len(self._buffer) >= PART_BYTES:
            await self._part(bytes(self._buffer[:PART_BYTES]))
            del self._buffer[:PART_BYTES]

    async def close(self) -> FileView:
        """The last part and the file's size; the file exists once the transaction commits."""
        if self._buffer:
            await self._part(bytes(self._buffer))
            self._buffer.clear()
        new = self._new
        await self._session.execute(
            update(StoredFile).where(StoredFile.id == new.id).values(bytes=self._size)
        )
        return FileView(
            new.id, new.purpose, new.filename, self._size, self._created_at, new.expires_at
        )

    async def _part(self, data: bytes) -> None:
        await self._session.execute(
            insert(FilePart).values(file_id=self._new.id, seq=self._seq, data=data)
        )
        self._seq += 1


class QuotaExceeded(Exception):
    """The key's stored uploads and this one would pass its storage limit."""

    def __init__(self, stored: int) -> None:
        super().__init__(stored)
        self.stored = stored


class FileStore(SessionStore):
    async def create(self, new: NewFile, content: bytes, quota: int | None) -> FileView:
        """The file whole, in one transaction; QuotaExceeded (nothing written) when the owner's
        live uploads and this one would hold more than `quota` bytes."""
        async with self._sessions.begin() as session:
            if new.owner is not None:
                # Serializes a key's uploads on PostgreSQL, so two at once cannot both pass the
                # quota (SQLite has one writer at a time anyway).
                await session.execute(
                    select(ApiKey.id).where(ApiKey.id == new.owner).with_for_update()
                )
            if quota is not None:
                stored = await self._stored(session, new.owner)
                if stored + len(content) > quota:
                    raise QuotaExceeded(stored)
            writer = await FileWriter.open(session, new)
            for start in range(0, len(content), PART_BYTES):
                await writer.write(content[start : start + PART_BYTES])
            return await writer.close()

    async def _stored(self, session: AsyncSession, owner: Owner) -> int:
        total = await session.scalar(
            select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(
                owned_by(StoredFile.api_key_id, owner),
                StoredFile.purpose.in_(UPLOAD_PURPOSES),
                _live(),
            )
        )
        return int(total or 0)

    async def get(self, file_id: str, owner: Owner) -> FileView | None:
        """The owner's live file; None for a file that does not exist, expired, or is another
        key's (the caller cannot tell these apart)."""
        async with self._sessions() as session:
            row = await session.scalar(self._mine(file_id, owner))
            return _view(row) if row is not None else None

    def _mine(self, file_id: str, owner: Owner) -> Any:
        return select(StoredFile).where(
            StoredFile.id == file_id, owned_by(StoredFile.api_key_id, owner), _live()
        )

    async def list_files(
        self, owner: Owner, after: str | None, limit: int, order: Order, purpose: str | None
    ) -> Page[FileView] | None:
        """The owner's live files by creation time, from just after the file `after`; None when
        `after` is not one of them."""
        newest_first = order == "desc"
        query = select(StoredFile).where(owned_by(StoredFile.api_key_id, owner), _live())
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        created, key = StoredFile.created_at, StoredFile.id
        query = query.order_by(
            *((created.desc(), key.desc()) if newest_first else (created.asc(), key.asc()))
        )
        async with self._sessions() as session:
            if after is not None:
                cursor = await session.scalar(self._mine(after, owner))
                if cursor is None:
                    return None
                if newest_first:
                    beyond = or_(
                        created < cursor.created_at,
                        and_(created == cursor.created_at, key < cursor.id),
                    )
                else:
                    beyond = or_(
                        created > cursor.created_at,
                        and_(created == cursor.created_at, key > cursor.id),
                    )
                query = query.where(beyond)
            rows = (await session.scalars(query.limit(limit + 1))).all()
        return Page([_view(row) for row in rows[:limit]], has_more=len(rows) > limit)

    async def delete(self, file_id: str, owner: Owner) -> bool:
        """Deletes the owner's file and its bytes; False when it has no such file."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                delete(StoredFile).where(
                    StoredFile.id == file_id, owned_by(StoredFile.api_key_id, owner), _live()
                )
            )
            return bool(getattr(result, "rowcount", 0))

    async def content(self, file_id: str, owner: Owner) -> bytes | None:
        """The owner's file's bytes, whole (an input file, bounded by GATEWAY_FILE_MAX_BYTES)."""
        chunks = await self.parts(file_id, owner)
        if chunks is None:
            return None
        return b"".join([chunk async for chunk in chunks])

    async def parts(self, file_id: str, owner: Owner) -> AsyncIterator[bytes] | None:
        """The owner's file's bytes a part at a time, each read on its own (a download holds one
        part in memory); None when the owner has no such file."""
        view = await self.get(file_id, owner)
        if view is None:
            return None
        return self._read_parts(file_id, -(-view.bytes // PART_BYTES))

    async def _read_parts(self, file_id: str, count: int) -> AsyncIterator[bytes]:
        for seq in range(count):
            async with self._sessions() as session:
                data = await session.scalar(
                    select(FilePart.data).where(FilePart.file_id == file_id, FilePart.seq == seq)
                )
            if data is None:
                return  # deleted while being read
            yield data

    async def delete_expired(self) -> int:
        """Deletes every file past its expiry (its parts go with it); returns how many."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                delete(StoredFile).where(
                    StoredFile.expires_at.is_not(None), StoredFile.expires_at <= utcnow()
                )
            )
            return int(getattr(result, "rowcount", 0))


async def file_exists(session: AsyncSession, file_id: str, owner: Owner) -> bool:
    """Whether the owner's live file exists, read inside the caller's transaction (and on
    PostgreSQL locked against a concurrent delete until it ends)."""
    found = await session.scalar(
        select(StoredFile.id)
        .where(StoredFile.id == file_id, owned_by(StoredFile.api_key_id, owner), _live())
        .with_for_update()
    )
    return found is not None
