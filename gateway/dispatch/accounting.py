"""What a dispatch accounts for besides streaming: the limits it runs under, what it asks of the
service that routed it (Placement), and recording its outcome in the request log without making
the caller wait on, or fail for, the database (the request log is written behind the requests:
gateway/stores/request_writer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.dispatch.request import PreparedCompletion
from gateway.metrics import GatewayMetrics
from gateway.routing.types import RoutingRequest
from gateway.sites.registry import SiteState
from gateway.stores.request_log import NewSample, Outcome
from gateway.stores.request_writer import RequestLogWriter

# How long a stopping gateway waits for outcomes the database has not taken yet.
_DRAIN_BACKLOG_S = 10.0


@dataclass(frozen=True, slots=True)
class DispatchLimits:
    # The request's deadline over every site it tries (GATEWAY_REQUEST_TIMEOUT_S).
    request_timeout_s: float
    # How long an answer whose client set no length limit may run before it ends with
    # finish_reason "length" (GATEWAY_OPEN_ANSWER_TIMEOUT_S; below request_timeout_s).
    open_answer_s: float
    # How many times a started answer may move to another site (GATEWAY_MAX_CONTINUATIONS).
    max_continuations: int
    # Whether finished answers leave a length sample for retraining (GATEWAY_COLLECT_SAMPLES).
    collect_samples: bool


class Placement(Protocol):
    """What a dispatch asks of the stage that routed it (gateway/request_path/route.py's Router
    provides it)."""

    def reroute(
        self,
        prepared: PreparedCompletion,
        excluded: set[str],
        routing: RoutingRequest | None = None,
    ) -> SiteState | None:
        """Another site for the request, not one of `excluded`."""
        ...

    def decode_answer(self, model: str, token_ids: Sequence[int]) -> str:
        """Answer tokens as the sites' detokenizer writes them."""
        ...

    def token_bytes(self, model: str, token_id: int) -> bytes:
        """A token's own bytes (logprobs' `bytes`)."""
        ...


class LengthFeedback(Protocol):
    """Learns from served answer lengths (gateway/prediction/adapter_lengths.py)."""

    def served(
        self, prepared: PreparedCompletion, completion_tokens: int, finish_reason: str | None
    ) -> None: ...


class OutcomeRecorder:
    """Queues requests' outcomes and offloads for the request log's writer, which writes them in
    batches and keeps what the database does not take until it does (usage per key is summed
    from outcomes); drain() writes what is left at shutdown."""

    def __init__(self, writer: RequestLogWriter, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self.writer = writer

    def record_finished(
        self, request_id: str, outcome: Outcome, sample: NewSample | None = None
    ) -> None:
        """Queues the outcome of a request (with its length sample): neither a cancelled caller
        (client gone) nor a database that is briefly away loses it."""
        self.writer.finished(request_id, outcome, sample)

    def record_offload(self, request_id: str, giver: SiteState, taker: SiteState) -> None:
        self._metrics.offloads.labels(giver.name, taker.name).inc()
        self.writer.offloaded(request_id, giver.site_id, taker.site_id)

    async def drain(self) -> None:
        await self.writer.drain(_DRAIN_BACKLOG_S)
