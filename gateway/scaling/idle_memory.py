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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from gateway.scaling.config import LocalSlot

log = logging.getLogger(__name__)
MIB = 1 << 20


class LendFailed(Exception):
    """The lending call did not reach the site or the site answered with an error."""


class Lender(Protocol):
    async def room(self, site: str) -> int:
        """The bytes `site` could lend now (0 while it lends). LendFailed: no answer."""
        ...

    async def lend(self, site: str, wanted_bytes: int) -> int:
        """Asks `site` to lend the top of its KV cache: the bytes lent (0: refused; a site
        lends whole blocks, so possibly a little over `wanted_bytes`). LendFailed: no answer."""
        ...

    async def take_back(self, site: str) -> None:
        """The borrower's memory is free again: `site` takes its lending back. LendFailed: no
        answer."""
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


class IdleMemory:
    """Contract: `place(instance, rooms, budget)` lends `budget` bytes for `instance` from one
    room (None: no room could; start it on a new GPU); `retire(instance)` gives its lending back
    (False: it borrowed nothing). A site lends to one instance at a time."""

    def __init__(self, lender: Lender) -> None:
        self._lender = lender
        self._borrowings: dict[str, Borrowing] = {}  # instance -> its lending

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
            lent = await self._try(room, budget_bytes)
            if lent:
                borrowing = Borrowing(instance, room.site, room.slot, lent)
                self._borrowings[instance] = borrowing
                return borrowing
        return None

    async def _try(self, room: Room, budget_bytes: int) -> int:
        """The bytes `room` lent for the budget, or 0 with nothing left lent."""
        try:
            lent = await self._lender.lend(room.site, budget_bytes)
        except LendFailed as exc:
            log.warning("site %s did not lend %d bytes: %s", room.site, budget_bytes, exc)
            return 0
        if budget_bytes <= lent <= room.lendable_bytes:
            return lent
        if lent:  # short of the budget, or more than it said it had: not this site's memory
            log.warning("site %s lent %d bytes for %d (%d lendable): given back", room.site,
                        lent, budget_bytes, room.lendable_bytes)  # fmt: skip
            await self._give_back(room.site)
        return 0

    async def retire(self, instance: str) -> bool:
        borrowing = self._borrowings.pop(instance, None)
        if borrowing is None:
            return False
        await self._give_back(borrowing.lender)
        return True

    async def _give_back(self, site: str) -> None:
        try:
            await self._lender.take_back(site)
        except LendFailed as exc:
            # The lender keeps a smaller cache until it restarts: a loss of capacity, not of
            # memory (what was lent is free, the borrower gone).
            log.warning("site %s could not take its lending back: %s", site, exc)


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
