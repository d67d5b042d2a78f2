"""Idle memory first (CoCoServe, ../shared/papers/cocoserve.txt): a short peak's new instance is
placed on a GPU a site already holds, in the free top of that site's KV cache, before a new GPU
is asked for; the site gets the memory back when the instance retires.

The lender is the site itself (site_engine/engine/core/kv_lending.py: only the free top of its
cache, never a block a running sequence holds, all or nothing, one lending at a time). This
module is the gateway's bookkeeping of it: which instance borrows from which site on which GPU,
how much, and that it goes back. A placement asks only a site whose lendable share covers the
instance's budget, the one with the most room first; a lending refused, short of the budget,
larger than the site said it could lend, or failed on the way, is given back where anything was
lent, and the next site is tried; none left: a new GPU (`place` answers None).

The instance runs beside its lender: the same slot's environment (CUDA_VISIBLE_DEVICES), its KV
cache sized to exactly what was lent (`--kv-cache-mib`, `beside`).

Each lending is held under a lease (docs/elastic.md, "Leases"): a random id only this gateway
knows, which alone returns or renews it at the site, and a term (`lease_ttl_s`) after which the
site takes the memory back unless renewed. `renew_due()`, called every scaling tick, renews each
lease a third of its term after its last renewal; a lending whose answer was lost is given back
by its lease id (the site may have lent before the answer went missing).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.scaling.config import LocalSlot
from gateway.sites.interface import KvLease

log = logging.getLogger(__name__)
MIB = 1 << 20
DEFAULT_LEASE_TTL_S = 60.0


class LendFailed(Exception):
    """The lending call did not reach the site or the site answered with an error."""


class LeaseLost(LendFailed):
    """The site holds no lending under the lease any more (it expired and was taken back)."""


class Lender(Protocol):
    async def room(self, site: str) -> int:
        """The bytes `site` could lend now (0 while it lends). LendFailed: no answer."""
        ...

    async def lend(self, site: str, wanted_bytes: int, lease: KvLease) -> int:
        """Asks `site` to lend the top of its KV cache under `lease`: the bytes lent (0:
        refused; a site lends whole blocks, so possibly a little over `wanted_bytes`).
        LendFailed: no answer."""
        ...

    async def take_back(self, site: str, lease_id: str) -> None:
        """The borrower's memory is free again: `site` takes the lease's lending back (nothing
        if it holds none under it). LendFailed: no answer."""
        ...

    async def renew(self, site: str, lease: KvLease) -> None:
        """Keeps the lending `lease.ttl_s` longer. LeaseLost: the site no longer holds it;
        LendFailed: no answer."""
        ...


@dataclass(frozen=True, slots=True)
class Room:
    """A site on a GPU this gateway holds and what its KV cache could lend now."""

    site: str
    slot: LocalSlot
    lendable_bytes: int


@dataclass(frozen=True, slots=True)
class Borrowing:
    instance: str
    lender: str
    slot: LocalSlot
    bytes: int
    # The lease the lender holds the lending under (its id is a secret: out of the repr).
    lease: KvLease = field(compare=False, repr=False)


class IdleMemory:
    """Contract: `place(instance, rooms, budget)` lends `budget` bytes for `instance` from one
    room (None: no room could; start it on a new GPU); `retire(instance)` gives its lending back
    (False: it borrowed nothing). A site lends to one instance at a time."""

    def __init__(
        self,
        lender: Lender,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lender = lender
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._borrowings: dict[str, Borrowing] = {}  # instance -> its lending
        self._renewed: dict[str, float] = {}  # instance -> when its lease was last renewed

    def borrowings(self) -> list[Borrowing]:
        return list(self._borrowings.values())

    def borrows(self, instance: str) -> bool:
        return instance in self._borrowings

    async def rooms(self, candidates: list[tuple[str, LocalSlot]]) -> list[Room]:
        """The rooms of `candidates` (site, slot) that could lend now: a site that lends
        already, has no room or did not answer (logged) is left out."""
        lending = {b.lender for b in self._borrowings.values()}
        rooms: list[Room] = []
        for site, slot in candidates:
            if site in lending:
                continue
            try:
                room = await self._lender.room(site)
            except LendFailed as exc:
                log.warning("site %s did not say its KV room: %s", site, exc)
                continue
            if room > 0:
                rooms.append(Room(site, slot, room))
        return rooms

    async def place(self, instance: str, rooms: list[Room], budget_bytes: int) -> Borrowing | None:
        if budget_bytes < MIB:
            raise ValueError(f"an instance's KV budget must be at least 1 MiB, not {budget_bytes}")
        if instance in self._borrowings:
            raise ValueError(f"{instance} already borrows from {self._borrowings[instance].lender}")
        lending = {b.lender for b in self._borrowings.values()}
        fitting = [r for r in rooms if r.site not in lending and r.lendable_bytes >= budget_bytes]
        for room in sorted(fitting, key=lambda r: -r.lendable_bytes):
            lease = KvLease(secrets.token_urlsafe(24), self._lease_ttl_s)
            lent = await self._try(room, budget_bytes, lease)
            if lent:
                borrowing = Borrowing(instance, room.site, room.slot, lent, lease)
                self._borrowings[instance] = borrowing
                self._renewed[instance] = self._clock()
                return borrowing
        return None

    async def _try(self, room: Room, budget_bytes: int, lease: KvLease) -> int:
        """The bytes `room` lent for the budget, or 0 with nothing left lent."""
        try:
            lent = await self._lender.lend(room.site, budget_bytes, lease)
        except LendFailed as exc:
            log.warning("site %s did not lend %d bytes: %s", room.site, budget_bytes, exc)
            # It may have lent before its answer went missing: the lease names that lending.
            await self._give_back(room.site, lease)
            return 0
        if budget_bytes <= lent <= room.lendable_bytes:
            return lent
        if lent:  # short of the budget, or more than it said it had: not this site's memory
            log.warning("site %s lent %d bytes for %d (%d lendable): given back", room.site,
                        lent, budget_bytes, room.lendable_bytes)  # fmt: skip
            await self._give_back(room.site, lease)
        return 0

    async def retire(self, instance: str) -> bool:
        borrowing = self._borrowings.pop(instance, None)
        self._renewed.pop(instance, None)
        if borrowing is None:
            return False
        await self._give_back(borrowing.lender, borrowing.lease)
        return True

    async def renew_due(self) -> None:
        """Renews each lease a third of its term after its last renewal (two more chances
        before it lapses). A lease the site no longer holds is logged: the site took its memory
        back, and the borrower runs on memory its lender may reuse."""
        now = self._clock()
        for instance, borrowing in list(self._borrowings.items()):
            if now - self._renewed.get(instance, now) < borrowing.lease.ttl_s / 3:
                continue
            try:
                await self._lender.renew(borrowing.lender, borrowing.lease)
            except LeaseLost as exc:
                log.error("site %s no longer lends to %s (its lease lapsed): %s",
                          borrowing.lender, instance, exc)  # fmt: skip
                self._renewed[instance] = float("inf")  # nothing left to renew
            except LendFailed as exc:
                log.warning("site %s: the lease of %s not renewed (tried again next tick): %s",
                            borrowing.lender, instance, exc)  # fmt: skip
            else:
                self._renewed[instance] = now

    async def _give_back(self, site: str, lease: KvLease) -> None:
        try:
            await self._lender.take_back(site, lease.id)
        except LendFailed as exc:
            # The site takes it back by itself once the lease lapses (its term, lease.ttl_s).
            log.warning("site %s could not take its lending back now (it will once the lease "
                        "lapses, in %g s at most): %s", site, lease.ttl_s, exc)  # fmt: skip


def beside(borrowing: Borrowing, overhead_bytes: int = 0) -> LocalSlot:
    """Where the borrowing instance runs: its lender's slot (the same GPU), its KV cache the
    lent memory less `overhead_bytes` (what the instance needs besides: weights, activations),
    in whole MiB, never more than lent."""
    kv_mib = (borrowing.bytes - overhead_bytes) // MIB
    if kv_mib < 1:
        raise ValueError(
            f"{borrowing.bytes} bytes lent leave no KV cache beside {overhead_bytes} of overhead"
        )
    return LocalSlot(borrowing.slot.env, (*borrowing.slot.args, "--kv-cache-mib", str(kv_mib)))
