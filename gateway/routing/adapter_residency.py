"""Where a site's LoRA adapters are, as the gateway sees it: the tiers of the site engine's
registry (site_engine/engine/lora/registry.py), from its load reports, plus what this gateway
routed there since.

A request of an adapter runs at once where the adapter sits in a device slot, after a copy of a
few milliseconds where it is in host memory, and after a read from disk (its files read and
checked: tenths of a second to seconds; the site measures it) anywhere else it is served.

Reports lag (a few hundred milliseconds) and an adapter's first request makes the site load it:
without the record of what was routed, a burst of a cold adapter's requests would see it cold
everywhere and be spread over every site, each loading it. So an adapter routed to a site counts
as in a device slot there for `pending_s` after (the load takes at most about that long; a
later report that still lacks it, after the window, wins).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from enum import IntEnum

# How long an adapter just routed to a site counts as in a slot there without a report saying so.
DEFAULT_PENDING_S = 5.0


class AdapterTier(IntEnum):
    """Where an adapter is at a site, nearest first (lower is better)."""

    DEVICE = 0
    HOST = 1
    DISK = 2


class SiteAdapters:
    """A site's adapter residency: its last report merged with the adapters routed there lately.
    Mutable, owned by the site's state (gateway/sites/registry.py); read on the event loop only."""

    def __init__(
        self,
        pending_s: float = DEFAULT_PENDING_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if pending_s < 0:
            raise ValueError(f"pending_s must be >= 0, got {pending_s}")
        self._pending_s = pending_s
        self._clock = clock
        self._device: frozenset[str] = frozenset()
        self._host: frozenset[str] = frozenset()
        self._load_s: float | None = None
        self._routed: dict[str, float] = {}

    def apply(self, on_device: Iterable[str], in_host: Iterable[str], load_s: float) -> None:
        """A load report's residency (load_s <= 0: not measured; the last measurement stays)."""
        self._device = frozenset(on_device)
        self._host = frozenset(in_host) - self._device
        if load_s > 0:
            self._load_s = load_s
        now = self._clock()
        stale = [a for a, at in self._routed.items() if now - at > self._pending_s]
        for adapter in stale:
            del self._routed[adapter]

    def routed(self, adapter: str) -> None:
        """A request of `adapter` was just routed here: the site is loading it, if it was not."""
        self._routed[adapter] = self._clock()

    def tier(self, adapter: str) -> AdapterTier:
        """Contract: DEVICE if the last report put it in a slot or it was routed here within
        pending_s; else HOST if the report put it in host memory; else DISK."""
        if adapter in self._device:
            return AdapterTier.DEVICE
        at = self._routed.get(adapter)
        if at is not None and self._clock() - at <= self._pending_s:
            return AdapterTier.DEVICE
        return AdapterTier.HOST if adapter in self._host else AdapterTier.DISK

    @property
    def load_s(self) -> float | None:
        """Mean seconds the site's last reads of an adapter from disk took; None: not measured."""
        return self._load_s

    @property
    def on_device(self) -> frozenset[str]:
        return self._device

    @property
    def in_host(self) -> frozenset[str]:
        return self._host
