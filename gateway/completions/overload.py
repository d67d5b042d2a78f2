"""Bounded admission: a cap on the client requests this gateway holds at once.

A request takes a slot when it is dispatched and gives it back when it ends. Over the cap the
caller gets 429 with Retry-After at once: a gateway that queued without bound would only turn
overload into timeouts (and memory). Sites are bounded separately, by the routing filter on
their queues (gateway/routing/filters.py: QueueBoundFilter), which answers 503 when every site
is full.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import gateway_overloaded


@dataclass(slots=True)
class InFlightBound:
    limit: int
    in_flight: int = 0
    refused: int = 0

    def enter(self) -> None:
        """Takes a slot, or raises Overloaded (429) when all are taken."""
        if self.in_flight >= self.limit:
            self.refused += 1
            raise gateway_overloaded(
                f"the gateway is serving its limit of {self.limit} requests; retry shortly"
            )
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight = max(self.in_flight - 1, 0)
