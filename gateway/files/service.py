"""The Files API's operations: upload, read, list, delete and download, each scoped to the
caller's key, and the deletion of expired files.

Batch input files (purpose `batch`) are checked line by line at upload
(gateway/files/batch_input.py), so a malformed file is refused then, naming the line, and
nothing is stored. Training data (purpose `fine-tune`) is refused past
GATEWAY_FINE_TUNING_MAX_FILE_BYTES, else stored as sent and checked line by line, against
the context of the job's model too, when a fine-tuning job is made from it
(gateway/fine_tuning/file_check.py), as OpenAI does. Batches write their results as files of
purpose `batch_output` (gateway/batches/finalize.py). Where files are stored and why:
gateway/stores/file_store.py.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from functools import partial

from gateway.db.models import utcnow
from gateway.errors import GatewayError, NotFound, invalid_request
from gateway.files.batch_input import parse_lines
from gateway.files.uploads import UploadGate
from gateway.settings import GatewaySettings
from gateway.stores.expiry import purge_forever
from gateway.stores.file_store import (
    UPLOAD_PURPOSE,
    UPLOAD_PURPOSES,
    FileStore,
    FileView,
    NewFile,
    Order,
    QuotaExceeded,
)
from gateway.stores.pages import Owner, Page
from gateway.tokenize_pool import TokenizePool

log = logging.getLogger(__name__)
# OpenAI's bounds on a file's expires_after.seconds.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400
MAX_FILE_PAGE = 10_000
MAX_FILENAME = 256


def file_too_large(param: str, size: int, limit: int) -> GatewayError:
    """400 for training data past GATEWAY_FINE_TUNING_MAX_FILE_BYTES, naming the limit."""
    return invalid_request(
        f"{param}: the file holds {size} bytes; fine-tuning takes files of at most {limit} "
        "bytes (GATEWAY_FINE_TUNING_MAX_FILE_BYTES; a job's training and validation files "
        "together): split it, or train on part of it",
        param=param,
        code="file_too_large",
    )


def file_not_found(file_id: str) -> GatewayError:
    return NotFound(f"No such File object: {file_id}", param="file_id", code="file_not_found")


class FileService:
    def __init__(self, settings: GatewaySettings, store: FileStore, pool: TokenizePool) -> None:
        self._settings = settings
        self.store = store
        self._pool = pool
        # Uploads under way per key, and validated at once (files and inline batches alike).
        self.uploads = UploadGate(
            settings.batches.uploads_in_flight, settings.batches.uploads_per_key
        )

    def expiry(self, expires_after_s: int | None) -> datetime:
        """When a file made now expires: after `expires_after_s` if given (OpenAI's bounds),
        else after GATEWAY_FILE_RETENTION_H."""
        if expires_after_s is None:
            return utcnow() + timedelta(hours=self._settings.files.retention_h)
        if not MIN_EXPIRY_S <= expires_after_s <= MAX_EXPIRY_S:
            raise invalid_request(
                f"expires_after[seconds] must be between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}",
                param="expires_after",
            )
        return utcnow() + timedelta(seconds=expires_after_s)

    async def upload(
        self,
        owner: Owner,
        filename: str,
        purpose: str,
        content: bytes,
        expires_after_s: int | None = None,
    ) -> FileView:
        """Checks and stores the file whole; 4xx and nothing stored for a purpose other than
        `batch` or `fine-tune`, a malformed batch line, a bad expiry or a key whose storage it
        would overflow. The caller bounds its size (GATEWAY_FILE_MAX_BYTES) while receiving
        it."""
        if purpose not in UPLOAD_PURPOSES:
            raise invalid_request(
                f"purpose '{purpose}' is not served: this gateway stores batch input files "
                "(purpose 'batch') and fine-tuning data (purpose 'fine-tune') only",
                param="purpose",
            )
        if not 0 < len(filename) <= MAX_FILENAME:
            raise invalid_request(
                f"the file's name must be 1 to {MAX_FILENAME} characters", param="file"
            )
        expires_at = self.expiry(expires_after_s)
        check = partial(
            parse_lines,
            max_lines=self._settings.batches.max_items,
            max_line_bytes=self._settings.limits.max_body_bytes,
        )
        if purpose == UPLOAD_PURPOSE:
            await self._pool.run(check, content)  # parsing 64 MiB stays off the event loop
        elif len(content) > self._settings.fine_tuning.max_file_bytes:
            # Its lines are checked when a job is made from it (as OpenAI does); its size now,
            # so that no file is kept that no job could be made from.
            raise file_too_large("file", len(content), self._settings.fine_tuning.max_file_bytes)
        new = NewFile(f"file-{uuid.uuid4().hex}", owner, purpose, filename, expires_at)
        quota = self._settings.files.storage_per_key_bytes
        try:
            return await self.store.create(new, content, quota)
        except QuotaExceeded as exc:
            raise invalid_request(
                f"this key stores {exc.stored} bytes of files; {len(content)} more would pass "
                f"its limit of {quota}: delete files (DELETE /v1/files/{{id}}) or let them "
                "expire",
                param="file",
                code="storage_limit_exceeded",
            ) from exc

    async def get(self, file_id: str, owner: Owner) -> FileView:
        found = await self.store.get(file_id, owner)
        if found is None:
            raise file_not_found(file_id)
        return found

    async def list_files(
        self, owner: Owner, after: str | None, limit: int, order: Order, purpose: str | None
    ) -> Page[FileView]:
        if not 1 <= limit <= MAX_FILE_PAGE:
            raise invalid_request(f"limit must be in 1..{MAX_FILE_PAGE}", param="limit")
        page = await self.store.list_files(owner, after, limit, order, purpose)
        if page is None:
            raise invalid_request(f"after: no file with id '{after}'", param="after")
        return page

    async def delete(self, file_id: str, owner: Owner) -> None:
        if not await self.store.delete(file_id, owner):
            raise file_not_found(file_id)

    async def content(self, file_id: str, owner: Owner) -> tuple[FileView, AsyncIterator[bytes]]:
        """The file and its bytes, read a part at a time as they are sent."""
        view = await self.get(file_id, owner)
        parts = await self.store.parts(file_id, owner)
        if parts is None:
            raise file_not_found(file_id)  # deleted in between
        return view, parts

    async def delete_expired_forever(self) -> None:
        """Deletes expired files now and every few minutes (a background task)."""
        await purge_forever(self.store.delete_expired, "files", "expiry", log)
