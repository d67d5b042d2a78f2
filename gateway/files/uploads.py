"""Bounds on the uploads one gateway takes at once: files and batches, each up to tens of MiB
held in memory while it arrives, is parsed and its requests tokenized.

Two stages, bounded apart. Receiving: one key has at most `per_key` uploads under way
(GATEWAY_BATCH_UPLOADS_PER_KEY, one by default; 429 with Retry-After beyond, before the body is
read), from its first byte to its answer, and nothing else bounds it: how long a body takes is
its client's doing, so a key whose bodies stall holds only its own share, and another key is
never refused for it (issue 48: four keys re-stalling header-only uploads held a shared cap of
four, and a fifth key got 429 for as long as they kept at it). A body that stops arriving is
cut by the connection's body deadline (GATEWAY_BODY_TIMEOUT_S, gateway/api/http_protocol.py),
which gives its key's share back. Validating: once its body is in, an upload waits for one of
`limit` places (GATEWAY_BATCH_UPLOADS_IN_FLIGHT), the gateway's own work, which no client can
stretch; the waiting ones are taken in their order of arrival.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from gateway.errors import gateway_overloaded


@dataclass(slots=True)
class UploadGate:
    # Uploads validated at once; the others whose bodies are in wait for a place.
    limit: int
    # Uploads one key has under way, from receiving to the answer.
    per_key: int = 1
    _by_key: Counter[int | None] = field(default_factory=Counter)
    _places: asyncio.Semaphore = field(init=False)
    _validating: int = 0

    def __post_init__(self) -> None:
        self._places = asyncio.Semaphore(self.limit)

    @property
    def in_flight(self) -> int:
        """Uploads under way, every key's together."""
        return self._by_key.total()

    @property
    def validating_now(self) -> int:
        return self._validating

    @contextmanager
    def admit(self, key_id: int | None) -> Iterator[None]:
        """Holds one of the key's places for the whole upload; 429 if it has none left."""
        if self._by_key[key_id] >= self.per_key:
            raise gateway_overloaded(
                f"this key has {self.per_key} batch upload(s) in progress, its limit on this "
                "gateway; retry when one ends"
            )
        self._by_key[key_id] += 1
        try:
            yield
        finally:
            self._by_key[key_id] -= 1
            if not self._by_key[key_id]:
                del self._by_key[key_id]

    @asynccontextmanager
    async def validating(self) -> AsyncIterator[None]:
        """One of the gateway's places to validate a received upload, waited for in turn."""
        async with self._places:
            self._validating += 1
            try:
                yield
            finally:
                self._validating -= 1
