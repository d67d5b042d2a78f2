"""Stage 3, admit: whether the gateway takes the request now, and its key's limits charged.

Two moments. Before anything else (the prediction included, which a lone request may run on the
event loop): a cap on the client requests this gateway holds at once, and no new request while
the request log's writes the database has not taken fill their queue (accepted work is never
lost). Once the answer length is predicted: the caller's key is charged the tokens it will
likely take (tenancy/admission.py), and settled with what it really took when it ends.

A request is admitted whole or not at all: a /v1/completions prompt list is one request to its
key (one of its requests per minute, one concurrency slot, the tokens of every prompt charged
together and settled once every prompt has ended, as OpenAI counts a list), and takes a place
in the gateway's bound for each of its prompts (each is a request to a site), all of them or
none.

Over the cap the caller gets 429 with Retry-After at once: a gateway that queued without bound
would only turn overload into timeouts (and memory). Sites are bounded separately, by the
routing filter on their queues (gateway/routing/filters.py: QueueBoundFilter), which answers
503 when every site is full.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.dispatch.request import Admission, AdmissionPart, PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.errors import gateway_overloaded, service_unavailable
from gateway.stores.request_writer import RequestLogWriter


@dataclass(slots=True)
class InFlightBound:
    limit: int
    in_flight: int = 0
    refused: int = 0

    def enter(self, count: int = 1) -> None:
        """Takes `count` slots, or none and raises Overloaded (429) when they are not free."""
        if self.in_flight + count > self.limit:
            self.refused += 1
            raise gateway_overloaded(
                f"the gateway is serving its limit of {self.limit} requests; retry shortly"
            )
        self.in_flight += count

    def leave(self, count: int = 1) -> None:
        self.in_flight = max(self.in_flight - count, 0)


class Admitter:
    """Owns the gateway's in-flight bound; reads the request log's backlog (the record stage's
    writer) to refuse new work while it is full."""

    def __init__(self, max_in_flight: int, backlog: RequestLogWriter) -> None:
        self.bound = InFlightBound(max_in_flight)
        self._backlog = backlog

    def enter(self, prompts: int = 1) -> None:
        """Takes a slot for each of a request's prompts: 503 while the request log is behind,
        429 when the gateway would hold more than GATEWAY_MAX_IN_FLIGHT requests."""
        if self._backlog.full:
            raise service_unavailable(
                "the gateway's request log is behind (the database is not taking writes); "
                "retry shortly"
            )
        self.bound.enter(prompts)

    def leave(self, prompts: int = 1) -> None:
        """Gives back the slots of a request that was not dispatched."""
        self.bound.leave(prompts)

    def hold_until_done(self, dispatch: Dispatch) -> None:
        """The slot of a dispatched request comes back when it ends, or when its Dispatch is
        dropped unused (a stream the server never started because the client had gone)."""
        dispatch.slot = weakref.finalize(dispatch, self.bound.leave)

    @property
    def alone(self) -> bool:
        """Whether the one request in flight is the caller's own."""
        return self.bound.in_flight == 1

    @staticmethod
    async def charge(prompts: Sequence[PreparedCompletion], admission: Admission | None) -> None:
        """Charges the caller's key the request's likely tokens, every prompt's together, as
        one request (429 when its limits refuse them); nothing without a key."""
        if admission is None:
            return
        charged = most = 0
        for prepared in prompts:
            likely, at_most = _tokens(prepared)
            charged += likely
            most += at_most
        await admission.charge(charged, most)

    @staticmethod
    def refund(admission: Admission | None) -> None:
        """Settles a request no site took: nothing was processed."""
        if admission is not None:
            admission.settle(0)

    @staticmethod
    def parts(admission: Admission | None, prompts: int) -> list[AdmissionPart | None]:
        """What each prompt's dispatch holds of the request's admission: the whole of it for
        one prompt, a share of it for each of a list's."""
        if admission is None or prompts == 1:
            return [admission] * prompts
        shared = SharedAdmission(admission, prompts)
        return [shared] * prompts


def _tokens(prepared: PreparedCompletion) -> tuple[int, int]:
    """The tokens a prompt is charged (its prompt and predicted answers) and the most it may
    take (its prompt and max_tokens for each answer)."""
    routing = prepared.routing
    most = routing.prompt_tokens + routing.max_tokens * routing.n
    # ignore_eos answers run to max_tokens whatever was predicted: charged as such.
    return (most if prepared.params.options.ignore_eos else routing.total_tokens), most


@dataclass(slots=True, eq=False)
class SharedAdmission:
    """The admission of a prompt list, shared by its prompts' dispatches: each settles its own
    tokens, and the key is settled once, with all of them, when the last one has; revoking the
    key stops every one of them."""

    whole: Admission
    left: int
    tokens: int = 0
    _stops: list[Callable[[], None]] = field(default_factory=list)
    _revoked: bool = False

    @property
    def api_key_id(self) -> int | None:
        return self.whole.api_key_id

    def settle(self, tokens: int) -> None:
        self.tokens += tokens
        self.left -= 1
        if self.left == 0:
            self.whole.settle(self.tokens)

    def watch_revocation(self, stop: Callable[[], None]) -> None:
        if self._revoked:
            stop()
            return
        self._stops.append(stop)
        if len(self._stops) == 1:
            self.whole.watch_revocation(self._revoke)

    def _revoke(self) -> None:
        self._revoked = True
        for stop in self._stops:
            stop()
