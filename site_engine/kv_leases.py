"""The site's side of lending its KV memory under a lease (docs/elastic.md, "Leases").

A lending (PagedEngine.lend_kv: the free top of the cache released for an instance beside the
site) is held by the lease its caller named: only a call naming that lease returns it or renews
it. A lease not renewed within its term expires, and the site takes the memory back by itself
(PagedEngine.return_kv): a gateway that crashed, lost its connection or forgot the borrowing
cannot leave the site's cache small for ever. Where the memory cannot be had again (the
borrower still holds it on the GPU), the take-back is tried every `retry_s` until it can.

The engine's own calls are used as they are; this module is only their bookkeeping, and the
one place they are called from the gRPC face (site_engine/grpc_kv_lending.py), one at a time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)
MIN_TTL_S = 1.0
MAX_TTL_S = 3600.0
# A lease id is a bearer secret the caller chose: long enough not to be guessed.
_LEASE_ID = re.compile(r"^[\x21-\x7e]{16,128}$")


class LendingEngine(Protocol):
    async def lend_kv(self, wanted_bytes: int) -> int: ...

    async def return_kv(self) -> int: ...


class LeaseArgumentError(ValueError):
    """A lease id or term the site does not take (INVALID_ARGUMENT)."""


class AlreadyLending(ValueError):
    """The site lends under another lease (FAILED_PRECONDITION)."""


class LeaseNotHeld(LookupError):
    """No lending is held under that lease now (NOT_FOUND for a renewal)."""


@dataclass(slots=True)
class Lease:
    id: str
    bytes: int
    expires_at: float  # on the leases' clock
    # Past its term: its memory is being taken back, and it can no longer be renewed.
    expired: bool = False


def check_lease(lease_id: str, ttl_s: float | None = None) -> None:
    if not _LEASE_ID.match(lease_id):
        raise LeaseArgumentError("a lease id is 16..128 printable ASCII characters")
    if ttl_s is not None and not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise LeaseArgumentError(
            f"a lease's term is {MIN_TTL_S:g}..{MAX_TTL_S:g} s, not {ttl_s:g} s"
        )


class KvLeases:
    """Contract: `lend(lease, bytes, ttl_s)` lends under the lease (the bytes lent, 0: refused,
    nothing held); `give_back(lease)` returns the lending if that lease holds it (the bytes
    returned, else 0 and nothing changes); `renew(lease, ttl_s)` extends its term (LeaseNotHeld
    otherwise); a lease past its term is taken back by the site."""

    def __init__(
        self,
        engine: LendingEngine,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = 1.0,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._retry_s = retry_s
        self._lease: Lease | None = None
        self._lock = asyncio.Lock()
        self._reclaimer: asyncio.Task[None] | None = None

    def held(self) -> Lease | None:
        return self._lease

    def _holds(self, lease_id: str) -> Lease | None:
        lease = self._lease
        if lease is not None and hmac.compare_digest(lease.id.encode(), lease_id.encode()):
            return lease
        return None

    async def lend(self, lease_id: str, wanted_bytes: int, ttl_s: float) -> int:
        check_lease(lease_id, ttl_s)
        async with self._lock:
            if self._lease is not None:
                raise AlreadyLending("this site already lends its KV memory (under another lease)")
            lent = await self._engine.lend_kv(wanted_bytes)
            if lent:
                self._lease = Lease(lease_id, lent, self._clock() + ttl_s)
                # A new watch: the one before may sleep until an earlier lease's later term.
                # (It cannot be taking memory back now: this holds the lock.)
                self._stop_watching()
                self._reclaimer = asyncio.create_task(self._reclaim_when_due())
            return lent

    def _stop_watching(self) -> None:
        if self._reclaimer is not None and self._reclaimer is not asyncio.current_task():
            self._reclaimer.cancel()
        self._reclaimer = None

    async def give_back(self, lease_id: str) -> int:
        check_lease(lease_id)
        async with self._lock:
            if self._holds(lease_id) is None:
                if self._lease is not None:
                    log.warning("a KV return named another lease than the one held: refused")
                return 0
            returned = await self._engine.return_kv()  # raises: still lent, still held
            self._lease = None
            self._stop_watching()
            return returned

    async def renew(self, lease_id: str, ttl_s: float) -> int:
        check_lease(lease_id, ttl_s)
        async with self._lock:
            lease = self._holds(lease_id)
            if lease is None or lease.expired:
                raise LeaseNotHeld("no KV lending is held under this lease")
            lease.expires_at = self._clock() + ttl_s
            return lease.bytes

    async def _reclaim_when_due(self) -> None:
        """Sleeps until the lease's term ends (renewals move it), then takes the memory back."""
        while (lease := self._lease) is not None:
            due = lease.expires_at - self._clock()
            if due > 0 and not lease.expired:
                await asyncio.sleep(due)
                continue
            async with self._lock:
                if self._lease is not lease or lease.expires_at > self._clock():
                    continue  # returned, or renewed while this waited for the lock
                lease.expired = True
                try:
                    returned = await self._engine.return_kv()
                except Exception:
                    log.exception("an expired KV lease's memory could not be had again; "
                                  "retried in %g s", self._retry_s)  # fmt: skip
                else:
                    log.warning("a KV lease of %d bytes expired unrenewed: %d bytes taken back",
                                lease.bytes, returned)  # fmt: skip
                    self._lease = None
                    continue
            await asyncio.sleep(self._retry_s)
