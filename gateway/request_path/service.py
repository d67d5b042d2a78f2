"""The request path's coordinator: CompletionService sequences the stages, and holds no logic of
its own but their order. The API's controllers, chat and batches call it.

prepare() checks everything that can be checked without a site (so bad input changes nothing);
dispatch() admits, predicts, routes and records the request and hands it to a Dispatch
(gateway/dispatch/stream.py), which streams it from the chosen site and records the outcome.
"""

from __future__ import annotations

import time

from gateway.completions.request import CompletionRequest
from gateway.dispatch.accounting import DispatchLimits
from gateway.dispatch.request import Admission, PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.metrics import GatewayMetrics
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import PredictorService
from gateway.request_path.admit import Admitter
from gateway.request_path.predict import LengthPrediction
from gateway.request_path.prepare import Preparer
from gateway.request_path.record import RequestRecords
from gateway.request_path.route import Router
from gateway.routing.policy import RoutingPolicy
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers


class CompletionService:
    def __init__(
        self,
        settings: GatewaySettings,
        registry: SiteRegistry,
        tokenizers: ModelTokenizers,
        policy: RoutingPolicy,
        request_log: RequestLog,
        predictors: ModelPredictors | None = None,
        metrics: GatewayMetrics | None = None,
        shared_prefix_cache_models: frozenset[str] = frozenset(),
        embedding_models: frozenset[str] = frozenset(),
    ) -> None:
        """`shared_prefix_cache_models`: models whose sites share cached prompt blocks across
        API keys (the federation file's `share_prefix_cache`); `embedding_models`: those that
        serve /v1/embeddings only."""
        self.metrics = metrics or GatewayMetrics()
        self.preparer = Preparer(
            settings, registry, tokenizers, shared_prefix_cache_models, embedding_models
        )
        self.prediction = LengthPrediction(predictors or ModelPredictors(PredictorService(None)))
        self.records = RequestRecords(settings, request_log, self.metrics)
        self.admitter = Admitter(settings.limits.max_in_flight, self.records.writer)
        self.router = Router(registry, policy, tokenizers, self.metrics)
        self.limits = DispatchLimits(
            request_timeout_s=settings.limits.request_timeout_s,
            max_continuations=settings.limits.max_continuations,
            collect_samples=settings.predictor.collect_samples,
        )

    def prepare(self, req: CompletionRequest) -> PreparedCompletion:
        """A /v1/completions request, validated and tokenized (gateway/request_path/prepare.py)."""
        return self.preparer.prepare(req)

    def prepare_prompts(self, req: CompletionRequest) -> list[PreparedCompletion]:
        return self.preparer.prepare_prompts(req)

    async def dispatch(
        self, prepared: PreparedCompletion, admission: Admission | None = None
    ) -> Dispatch:
        """Admits, predicts, routes and records the request; 503 (recorded as failed) when no
        site can take it; 429 (not recorded) when `admission` refuses the predicted tokens or
        the gateway already holds its limit of requests (GATEWAY_MAX_IN_FLIGHT); 503 while the
        writes the database has not taken fill their queue (accepted work is never lost)."""
        self.admitter.enter()
        try:
            dispatch = await self._dispatch(prepared, admission)
        except BaseException:
            self.admitter.leave()
            raise
        self.admitter.hold_until_done(dispatch)
        return dispatch

    async def _dispatch(
        self, prepared: PreparedCompletion, admission: Admission | None
    ) -> Dispatch:
        started = time.monotonic()
        prepared = self.preparer.salted(
            prepared, admission.api_key_id if admission is not None else None
        )
        prepared, prediction = await self.prediction.apply(prepared, alone=self.admitter.alone)
        await self.admitter.charge(prepared, admission)
        decision = self.router.route(prepared)
        site = decision.site
        # Built (and counted on its site) before the next await: the next request of a burst
        # must see it.
        dispatch = (
            self.open_dispatch(prepared, site, started_at=started, admission=admission)
            if site is not None
            else None
        )
        self.records.accepted(prepared, decision, prediction, admission)
        if dispatch is None:
            self.admitter.refund(admission)
            raise self.records.no_site(prepared, decision)
        self.records.routed_prompt(prepared, dispatch.site)
        return dispatch

    def open_dispatch(
        self,
        prepared: PreparedCompletion,
        site: SiteState,
        started_at: float | None = None,
        admission: Admission | None = None,
    ) -> Dispatch:
        """A Dispatch of the prepared request on `site`, counted there at once (its lease)."""
        return Dispatch(
            prepared,
            site,
            placement=self.router,
            recorder=self.records.outcomes,
            limits=self.limits,
            metrics=self.metrics,
            started_at=time.monotonic() if started_at is None else started_at,
            admission=admission,
        )

    async def drain(self) -> None:
        await self.records.drain()
