"""The embeddings request path: the stages a completion goes through, with the same owners where
the stage is the same thing.

- prepare: EmbeddingPreparer (gateway/embeddings/prepare.py); a 4xx here changes nothing.
- admit: the request path's Admitter (one in-flight bound and one request-log backlog for every
  API), then the caller's key charged the input tokens (nothing is predicted: an embedding has
  no answer), 429 before anything is recorded.
- route: EmbeddingRouter (gateway/embeddings/route.py); the request counted on its site through
  a SiteLease before any await, so the rest of a burst sees it.
- embed: the site's Embed call; a site that is down or fails is left for another (the call
  changes nothing at a site, so it is simply sent again elsewhere), a site that refuses the
  request as invalid is a 400, within GATEWAY_REQUEST_TIMEOUT_S over every attempt.
- record: the request log's row (api "embeddings", the input tokens as prompt_tokens, no
  completion tokens) and its outcome through the request path's writer, the key settled with
  the input tokens once a site was tried: what usage per key and the dashboard already sum.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gateway.db.models import RequestStatus
from gateway.dispatch.request import Admission
from gateway.embeddings.prepare import EmbeddingPreparer, PreparedEmbedding
from gateway.embeddings.request import EmbeddingRequest
from gateway.embeddings.route import EmbeddingRouter
from gateway.errors import (
    GatewayError,
    invalid_request,
    request_timed_out,
    service_unavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.request_path.admit import Admitter
from gateway.request_path.record import RequestRecords
from gateway.routing.policy import Decision
from gateway.sites.interface import (
    EmbedResult,
    SiteBusy,
    SiteFailed,
    SiteRejected,
    SiteTimedOut,
    SiteUnavailable,
)
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteState
from gateway.stores.request_log import NewRequest, Outcome

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Embedded:
    """A request's vectors, and the site that computed them."""

    prepared: PreparedEmbedding
    result: EmbedResult
    site: str


@dataclass(slots=True)
class _Attempts:
    """Where the request has been: every site tried, how many attempts, the last failure."""

    site: SiteState
    tried: set[str]
    count: int = 0
    last_failure: str | None = None


class EmbeddingService:
    def __init__(
        self,
        preparer: EmbeddingPreparer,
        router: EmbeddingRouter,
        admitter: Admitter,
        records: RequestRecords,
        metrics: GatewayMetrics,
        request_timeout_s: float,
    ) -> None:
        self.preparer = preparer
        self.router = router
        self._admitter = admitter
        self._records = records
        self._metrics = metrics
        self._timeout_s = request_timeout_s

    def prepare(self, req: EmbeddingRequest) -> PreparedEmbedding:
        return self.preparer.prepare(req)

    async def embed(self, prepared: PreparedEmbedding, admission: Admission | None) -> Embedded:
        """The request's vectors: 429 (not recorded) when the gateway is at its in-flight bound
        or the key's limits refuse the input tokens, 503 (recorded as failed) when no site can
        take it, 400 when its site refuses it, 504 past GATEWAY_REQUEST_TIMEOUT_S."""
        self._admitter.enter()
        try:
            return await self._embed(prepared, admission, time.monotonic())
        finally:
            self._admitter.leave()

    async def _embed(
        self, prepared: PreparedEmbedding, admission: Admission | None, started: float
    ) -> Embedded:
        tokens = prepared.prompt_tokens
        if admission is not None:
            await admission.charge(tokens, tokens)
        decision = self.router.route(prepared)
        site = decision.site
        lease = SiteLease.take(site, tokens) if site is not None else None
        self._records.writer.accepted(self._row(prepared, decision, admission))
        if site is None or lease is None:
            if admission is not None:
                admission.settle(0)  # nothing was processed
            raise self._no_site(prepared, decision)
        attempts = _Attempts(site, {site.name})
        status, error = RequestStatus.FAILED, None
        try:
            result = await self._attempts(prepared, lease, attempts, started)
            status = RequestStatus.COMPLETED
            return Embedded(prepared, result, attempts.site.name)
        except GatewayError as exc:
            error = exc.message
            raise
        except BaseException:  # CancelledError: the client went away
            status, error = RequestStatus.CANCELLED, "client went away"
            raise
        finally:
            lease.release()
            if admission is not None:
                admission.settle(tokens)  # a site took the inputs, as a completion's prompt
            self._finished(prepared, attempts, status, error)

    async def _attempts(
        self, prepared: PreparedEmbedding, lease: SiteLease, attempts: _Attempts, started: float
    ) -> EmbedResult:
        """The site's answer, moving to another site while one is down or fails."""
        while True:
            site = attempts.site
            attempts.count += 1
            lease.move(site, prepared.prompt_tokens)
            left = started + self._timeout_s - time.monotonic()
            if left <= 0:
                raise self._timed_out(prepared)
            try:
                return await site.client.embed(prepared.params, left)
            except SiteRejected as exc:
                raise invalid_request(exc.detail) from exc
            except SiteTimedOut as exc:
                raise self._timed_out(prepared) from exc
            except (SiteUnavailable, SiteFailed) as exc:
                attempts.last_failure = str(exc)
                if not isinstance(exc, SiteBusy):  # a full queue is no sign of ill health
                    site.mark_unhealthy(exc.detail)
                self._metrics.failovers.labels(site.name).inc()
                log.warning("%s; moving %s elsewhere", exc, prepared.request_id)
            lease.release()
            attempts.site = self._next_site(prepared, attempts)
            attempts.tried.add(attempts.site.name)

    def _next_site(self, prepared: PreparedEmbedding, attempts: _Attempts) -> SiteState:
        site = self.router.route(prepared, excluded=attempts.tried).site
        if site is None:
            raise service_unavailable(
                f"no other site can take request {prepared.request_id} (tried: "
                f"{', '.join(sorted(attempts.tried))}; last: {attempts.last_failure})"
            )
        return site

    def _timed_out(self, prepared: PreparedEmbedding) -> GatewayError:
        return request_timed_out(
            f"request {prepared.request_id} did not finish within "
            f"GATEWAY_REQUEST_TIMEOUT_S={self._timeout_s:g}s"
        )

    def _row(
        self,
        prepared: PreparedEmbedding,
        decision: Decision[SiteState],
        admission: Admission | None,
    ) -> NewRequest:
        site = decision.site
        return NewRequest(
            request_id=prepared.request_id,
            api="embeddings",
            model=prepared.model,
            stream=False,
            user=prepared.user,
            prompt_tokens=prepared.prompt_tokens,
            max_tokens=0,
            routing_policy=decision.policy,
            site_id=site.site_id if site is not None else None,
            api_key_id=admission.api_key_id if admission is not None else None,
            routing_detail={
                "survivors": [list(step) for step in decision.survivors],
                "scores": dict(decision.scores),
                "inputs": len(prepared.params.inputs),
            },
        )

    def _no_site(self, prepared: PreparedEmbedding, decision: Decision[SiteState]) -> GatewayError:
        reason = ", ".join(f"{name}: {count}" for name, count in decision.survivors)
        message = f"no site can serve model '{prepared.model}' now (sites left after {reason})"
        self._records.outcomes.record_finished(
            prepared.request_id, Outcome(RequestStatus.FAILED, None, 0, error=message)
        )
        return service_unavailable(message)

    def _finished(
        self,
        prepared: PreparedEmbedding,
        attempts: _Attempts,
        status: RequestStatus,
        error: str | None,
    ) -> None:
        site = attempts.site
        tokens = (prepared.prompt_tokens, 0)
        self._metrics.finished(site.name, prepared.model, status.value, tokens, None)
        outcome = Outcome(status, site.site_id, attempts.count, completion_tokens=0, error=error)
        self._records.outcomes.record_finished(prepared.request_id, outcome)
