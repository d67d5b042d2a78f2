"""Running an async exercise against a real database migrated for it, left empty afterwards
(the session's PostgreSQL database is shared by the tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.db.migrate import downgrade, upgrade


def run_migrated(url: str, exercise: Callable[[str], Coroutine[Any, Any, None]]) -> None:
    upgrade(url)
    try:
        asyncio.run(exercise(url))
    finally:
        downgrade(url)
