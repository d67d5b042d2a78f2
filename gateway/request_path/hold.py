"""Stage 4b, hold: a request no site takes because every site pushes back (each one's queue at
GATEWAY_SITE_MAX_QUEUED_REQUESTS / _TOKENS) waits here, up to GATEWAY_QUEUE_MAX_REQUESTS of
them, instead of its 503 at once; with 0 (the default) none waits.

Every GATEWAY_QUEUE_POLL_MS while any is held, the held requests are offered to routing in the
queue's order (gateway/routing/hold_order.py: priority classes first, then `fcfs` or `spf`,
shortest predicted answer first with aging and a bound on overtaking); a request finding no site
holds back the later ones of its model and adapter (the same sites), not the others'. The site a
request gets is taken at once, in the pass (its dispatch opened, its lease counted), so the next
request offered sees it. One held past GATEWAY_QUEUE_TIMEOUT_S gets its 503. A client that goes
away while held leaves the queue; one whose site was found as it went is given back, unsent.

The pass polls rather than listening to the sites: a site makes room when one of its requests
ends, when its load report comes (every GATEWAY_LOAD_REPORT_INTERVAL_MS) or when an operator
changes it, and a poll of a few milliseconds sees all of them without a hook in each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.dispatch.request import PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.queue_settings import QueueSettings
from gateway.request_path.route import Router
from gateway.routing.hold_order import HeldRequests, offer, pushed_back
from gateway.routing.policy import Decision
from gateway.routing.types import RoutingRequest
from gateway.sites.registry import SiteState

Placed = tuple[Dispatch, Decision[SiteState]]


@dataclass(slots=True, eq=False)
class _Waiting:
    prepared: PreparedCompletion
    routing: RoutingRequest  # built once: its prompt's block ids are hashed once
    open_dispatch: Callable[[SiteState], Dispatch]
    found: asyncio.Future[Placed | None]
    since: float


class GatewayQueue:
    """Owns the held requests and the pass that offers them to routing (the module docstring)."""

    def __init__(
        self, settings: QueueSettings, router: Router, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._router = router
        self._clock = clock
        self._held: HeldRequests[_Waiting] = HeldRequests(settings.hold_order)
        self._pass: asyncio.Task[None] | None = None
        self.held_total = 0
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._held)

    def takes(self, decision: Decision[SiteState]) -> bool:
        """Whether a request routing found no site for may wait here: every site pushed back
        and the queue has room."""
        return pushed_back(decision) and len(self._held) < self.settings.max_requests

    async def wait(
        self, prepared: PreparedCompletion, open_dispatch: Callable[[SiteState], Dispatch]
    ) -> Placed | None:
        """Holds the request until a site takes it: `open_dispatch(site)` runs then, in the
        pass, and its dispatch and routing decision are returned; None once held past the
        timeout."""
        found: asyncio.Future[Placed | None] = asyncio.get_running_loop().create_future()
        routing = prepared.routing
        waiting = _Waiting(prepared, routing, open_dispatch, found, self._clock())
        entry = self._held.hold(waiting, prepared.params.options.priority, routing.answer_tokens)
        self.held_total += 1
        if self._pass is None or self._pass.done():
            self._pass = asyncio.create_task(self._offer_while_held())
        try:
            return await found
        except asyncio.CancelledError:
            # The client went away; a site found in the same instant gets its request back.
            if found.done() and not found.cancelled() and (placed := found.result()) is not None:
                placed[0].abandon()
            raise
        finally:
            if entry.held:
                self._held.release(entry)

    async def _offer_while_held(self) -> None:
        poll_s = self.settings.poll_ms / 1000.0
        while self._held:
            await asyncio.sleep(poll_s)
            self.offer()

    def offer(self) -> int:
        """One pass: the held requests offered in order, then the timeouts; how many were
        placed."""
        placed = offer(self._held, self._place, _sites_of)
        now, timeout = self._clock(), self.settings.timeout_s
        for entry in self._held:
            waiting = entry.item
            if now - waiting.since >= timeout:
                self._held.release(entry)
                self.timed_out += 1
                if not waiting.found.done():
                    waiting.found.set_result(None)
        return len(placed)

    def _place(self, waiting: _Waiting) -> bool:
        """True once the request is settled here: placed on a site, failed to open there, or
        no longer awaited (its client gone); False while no site takes it."""
        if waiting.found.done():
            return True
        try:
            decision = self._router.decide(waiting.prepared, waiting.routing)
            site = decision.site
            if site is None:
                return False
            self._router.count(decision)
            dispatch = waiting.open_dispatch(site)
        except Exception as exc:  # the caller's request fails with it (a 400, say), not the pass
            waiting.found.set_exception(exc)
            return True
        waiting.found.set_result((dispatch, decision))
        return True

    async def close(self) -> None:
        """Stops the pass (shutdown); requests still held are answered None (their 503)."""
        if self._pass is not None:
            self._pass.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pass
        for entry in self._held:
            self._held.release(entry)
            if not entry.item.found.done():
                entry.item.found.set_result(None)


def _sites_of(waiting: _Waiting) -> tuple[str, str | None]:
    return (waiting.routing.model, waiting.routing.adapter)
