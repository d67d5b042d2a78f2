"""Stage 6, record: what the gateway keeps of a request. Its row in the request log once it is
routed (the site, the prediction, why routing chose as it did), its outcome when it ends (queued
by dispatch through the OutcomeRecorder), and, with GATEWAY_LOG_PROMPTS, its prompt in the log.

The request log is written behind the requests (gateway/stores/request_writer.py): rows and
outcomes wait in a bounded queue, written every few milliseconds in one transaction, and kept
while the database refuses them. Batch items write their row before they run
(gateway/batches/item_runner.py), with the same row builder.
"""

from __future__ import annotations

import logging

from gateway.db.models import RequestStatus
from gateway.dispatch.accounting import OutcomeRecorder
from gateway.dispatch.request import Admission, PreparedCompletion
from gateway.errors import GatewayError, service_unavailable
from gateway.metrics import GatewayMetrics
from gateway.prediction.service import Prediction
from gateway.routing.policy import Decision
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteState
from gateway.stores.request_log import NewRequest, Outcome, RequestLog
from gateway.stores.request_writer import RequestLogWriter

log = logging.getLogger(__name__)


def accepted_request(
    prepared: PreparedCompletion,
    *,
    routing_policy: str,
    site: SiteState | None,
    routing_detail: dict[str, object],
    api: str | None = None,
    api_key_id: int | None = None,
    predictor_version: str | None = None,
    predicted_p90_tokens: int | None = None,
) -> NewRequest:
    """The request log's row for a request accepted on `site` (None: no site could take it),
    for every API that dispatches completions (a batch item passes api="batch")."""
    params = prepared.params
    return NewRequest(
        request_id=prepared.request_id,
        api=api or prepared.api,
        model=prepared.model,
        adapter=prepared.params.options.adapter,
        stream=prepared.stream,
        user=prepared.user,
        prompt_tokens=len(params.prompt_token_ids),
        max_tokens=params.max_tokens,
        routing_policy=routing_policy,
        site_id=site.site_id if site is not None else None,
        api_key_id=api_key_id,
        predicted_tokens=params.predicted_tokens,
        predicted_bucket=prepared.predicted_bucket,
        predictor_version=predictor_version,
        predicted_p90_tokens=predicted_p90_tokens,
        routing_detail=routing_detail,
    )


class RequestRecords:
    """Owns the request log, its writer (the backlog admission reads) and the outcome recorder
    dispatch queues outcomes through."""

    def __init__(
        self, settings: GatewaySettings, request_log: RequestLog, metrics: GatewayMetrics
    ) -> None:
        self._log_prompts = settings.server.log_prompts
        self.request_log = request_log
        self.writer = RequestLogWriter(
            request_log,
            settings.limits.outcome_backlog_max,
            flush_s=settings.database.request_log_flush_ms / 1000,
        )
        self.outcomes = OutcomeRecorder(self.writer, metrics)
        metrics.watch_backlog(
            "outcome_backlog",
            "Requests whose rows or outcomes the database has not taken yet (written in batches "
            "every few ms, and kept while the database refuses them; usage per key is summed "
            "from them)",
            self.writer.__len__,
        )
        metrics.watch_backlog(
            "outcome_backlog_oldest_seconds",
            "How long the oldest write not taken yet has waited",
            self.writer.oldest_s,
        )

    def accepted(
        self,
        prepared: PreparedCompletion,
        decision: Decision[SiteState],
        prediction: Prediction | None,
        admission: Admission | None,
    ) -> None:
        """Queues the row of a routed request (decision.site None: no site could take it)."""
        self.writer.accepted(
            accepted_request(
                prepared,
                routing_policy=decision.policy,
                site=decision.site,
                api_key_id=admission.api_key_id if admission is not None else None,
                predictor_version=prediction.version if prediction else None,
                predicted_p90_tokens=prediction.p90_tokens if prediction else None,
                routing_detail={
                    "survivors": [list(step) for step in decision.survivors],
                    "scores": dict(decision.scores),
                    "planned_answer_tokens": decision.planned_answer_tokens,
                },
            )
        )

    def no_site(self, prepared: PreparedCompletion, decision: Decision[SiteState]) -> GatewayError:
        """Records the request failed because no site could take it; the 503 to answer."""
        reason = ", ".join(f"{name}: {count}" for name, count in decision.survivors)
        message = (
            f"no site can serve model '{prepared.served_model}' now (sites left after {reason})"
        )
        self.writer.finished(
            prepared.request_id, Outcome(RequestStatus.FAILED, None, 0, error=message)
        )
        return service_unavailable(message)

    def routed_prompt(self, prepared: PreparedCompletion, site: SiteState) -> None:
        """Logs the prompt of a routed request, only with GATEWAY_LOG_PROMPTS (off by default:
        prompts are the users' data)."""
        if self._log_prompts:
            log.info("%s to site %s, prompt: %r", prepared.request_id, site.name,
                     prepared.prompt_text)  # fmt: skip

    async def drain(self) -> None:
        """Writes what is left at shutdown, then closes the request log."""
        await self.outcomes.drain()
        await self.request_log.close()
