"""Rows kept for a time (files, stored responses) deleted once past it, by a background task."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

# Expired rows only cost space, and a sweep reads an index: every few minutes is soon enough.
PURGE_EVERY_S = 600.0


async def purge_forever(
    delete_expired: Callable[[], Awaitable[int]], kind: str, past: str, log: logging.Logger
) -> None:
    """Calls `delete_expired` now and every PURGE_EVERY_S, logging to `log` what it deleted of
    `kind` (rows past their `past`); a failure waits for the next sweep."""
    while True:
        try:
            deleted = await delete_expired()
            if deleted:
                log.info("%s: deleted %d past their %s", kind, deleted, past)
        except Exception:  # the database may be away for a moment: next time
            log.exception("%s: deleting expired %s failed", kind, kind)
        await asyncio.sleep(PURGE_EVERY_S)
