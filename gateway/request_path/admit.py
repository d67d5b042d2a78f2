"""Stage 3, admit: whether the gateway takes the request now, and its key's limits charged.

Two moments. Before anything else (the prediction included, which a lone request may run on the
event loop): a cap on the client requests this gateway holds at once, and no new request while
the request log's writes the database has not taken fill their queue (accepted work is never
lost). Once the answer length is predicted: the caller's key is charged the tokens it will
likely take (tenancy/admission.py), and settled with what it really took when it ends.

Over the cap the caller gets 429 with Retry-After at once: a gateway that queued without bound
would only turn overload into timeouts (and memory). Sites are bounded separately, by the
routing filter on their queues (gateway/routing/filters.py: QueueBoundFilter), which answers
503 when every site is full.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from gateway.dispatch.request import Admission, PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.errors import gateway_overloaded, service_unavailable
from gateway.stores.request_writer import RequestLogWriter


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


class Admitter:
    """Owns the gateway's in-flight bound; reads the request log's backlog (the record stage's
    writer) to refuse new work while it is full."""

    def __init__(self, max_in_flight: int, backlog: RequestLogWriter) -> None:
        self.bound = InFlightBound(max_in_flight)
        self._backlog = backlog

    def enter(self) -> None:
        """Takes a slot for a request: 503 while the request log is behind, 429 when the gateway
        already holds GATEWAY_MAX_IN_FLIGHT requests."""
        if self._backlog.full:
            raise service_unavailable(
                "the gateway's request log is behind (the database is not taking writes); "
                "retry shortly"
            )
        self.bound.enter()

    def leave(self) -> None:
        """Gives back the slot of a request that was not dispatched."""
        self.bound.leave()

    def hold_until_done(self, dispatch: Dispatch) -> None:
        """The slot of a dispatched request comes back when it ends, or when its Dispatch is
        dropped unused (a stream the server never started because the client had gone)."""
        dispatch.slot = weakref.finalize(dispatch, self.bound.leave)

    @property
    def alone(self) -> bool:
        """Whether the one request in flight is the caller's own."""
        return self.bound.in_flight == 1

    @staticmethod
    async def charge(prepared: PreparedCompletion, admission: Admission | None) -> None:
        """Charges the caller's key the request's likely tokens (429 when its limits refuse
        them); nothing without a key."""
        if admission is None:
            return
        routing = prepared.routing
        most = routing.prompt_tokens + routing.max_tokens * routing.n
        # ignore_eos answers run to max_tokens whatever was predicted: charged as such.
        charged = most if prepared.params.ignore_eos else routing.total_tokens
        await admission.charge(charged, most)

    @staticmethod
    def refund(admission: Admission | None) -> None:
        """Settles a request no site took: nothing was processed."""
        if admission is not None:
            admission.settle(0)
