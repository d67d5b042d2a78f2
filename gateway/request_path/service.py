"""The request path's coordinator: CompletionService sequences the stages, and holds no logic of
its own but their order. The API's controllers, chat and batches call it.

prepare() checks everything that can be checked without a site (so bad input changes nothing);
dispatch() admits, predicts, routes and records the request and hands it to a Dispatch
(gateway/dispatch/stream.py), which streams it from the chosen site and records the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.completions.request import CompletionRequest
from gateway.dispatch.accounting import DispatchLimits
from gateway.dispatch.request import Admission, AdmissionPart, PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.metrics import GatewayMetrics
from gateway.model_catalogue import AdapterCatalogue
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import Prediction, PredictorService
from gateway.request_path.admit import Admitter
from gateway.request_path.hold import GatewayQueue
from gateway.request_path.predict import LengthPrediction
from gateway.request_path.prepare import Preparer
from gateway.request_path.record import RequestRecords
from gateway.request_path.route import Router
from gateway.routing.policy import Decision, RoutingPolicy
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
        adapters: AdapterCatalogue | None = None,
    ) -> None:
        """`shared_prefix_cache_models`: models whose sites share cached prompt blocks across
        API keys (the federation file's `share_prefix_cache`); `embedding_models`: those that
        serve /v1/embeddings only; `adapters`: the LoRA adapters' owners (default: every
        adapter the sites serve is public)."""
        self.metrics = metrics or GatewayMetrics()
        self.preparer = Preparer(
            settings, registry, tokenizers, shared_prefix_cache_models, embedding_models, adapters
        )
        self.prediction = LengthPrediction(predictors or ModelPredictors(PredictorService(None)))
        self.records = RequestRecords(settings, request_log, self.metrics)
        self.admitter = Admitter(settings.limits.max_in_flight, self.records.writer)
        self.router = Router(registry, policy, tokenizers, self.metrics)
        # Requests held while every site pushes back (gateway/request_path/hold.py).
        self.queue = GatewayQueue(settings.queue, self.router)
        self.limits = DispatchLimits(
            request_timeout_s=settings.limits.request_timeout_s,
            open_answer_s=settings.limits.open_answer_s,
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
        site can take it (every site pushing back: once held in the gateway's queue past its
        timeout, when it holds any); 429 (not recorded) when `admission` refuses the predicted
        tokens or the gateway already holds its limit of requests (GATEWAY_MAX_IN_FLIGHT); 503
        while the writes the database has not taken fill their queue (accepted work is never
        lost)."""
        (dispatch,) = await self.dispatch_all((prepared,), admission)
        return dispatch

    async def dispatch_all(
        self, prompts: Sequence[PreparedCompletion], admission: Admission | None = None
    ) -> list[Dispatch]:
        """dispatch() for the prompts of one request (a /v1/completions prompt list), admitted
        whole or not at all (gateway/request_path/admit.py): one admission of the key for all
        of them, a place in the gateway's bound for each; nothing is recorded or sent to a site
        unless every prompt has a site."""
        self.admitter.enter(len(prompts))
        try:
            dispatches = await self._dispatch_all(prompts, admission)
        except BaseException:
            self.admitter.leave(len(prompts))
            raise
        for dispatch in dispatches:
            self.admitter.hold_until_done(dispatch)
        return dispatches

    async def _dispatch_all(
        self, prompts: Sequence[PreparedCompletion], admission: Admission | None
    ) -> list[Dispatch]:
        started = time.monotonic()
        key_id = admission.api_key_id if admission is not None else None
        key_name = admission.api_key_name if admission is not None else None
        planned: list[tuple[PreparedCompletion, Prediction | None]] = []
        for prepared in prompts:
            self.preparer.check_owner(prepared, key_id, key_name)
            salted = self.preparer.salted(prepared, key_id)
            planned.append(await self.prediction.apply(salted, alone=self.admitter.alone))
        await self.admitter.charge([prepared for prepared, _ in planned], admission)
        parts = self.admitter.parts(admission, len(planned))
        routed: list[tuple[Dispatch, Decision[SiteState], Prediction | None]] = []
        for (prepared, prediction), part in zip(planned, parts, strict=True):
            try:
                dispatch, decision = await self._site_for(prepared, part, started)
            except BaseException:
                for earlier, _, _ in routed:  # never recorded, never sent: nothing happened
                    earlier.abandon()
                raise
            if dispatch is None:
                for earlier, _, _ in routed:
                    earlier.abandon()
                self.records.accepted(prepared, decision, prediction, admission)
                self.admitter.refund(admission)
                raise self.records.no_site(prepared, decision)
            routed.append((dispatch, decision, prediction))
        for dispatch, decision, prediction in routed:
            self.records.accepted(dispatch.prepared, decision, prediction, admission)
            self.records.routed_prompt(dispatch.prepared, dispatch.site)
        return [dispatch for dispatch, _, _ in routed]

    async def _site_for(
        self, prepared: PreparedCompletion, part: AdmissionPart | None, started: float
    ) -> tuple[Dispatch | None, Decision[SiteState]]:
        """A dispatch of the request on the site routing picks, at once or once the gateway's
        queue gets it one (every site pushing back); None when no site takes it, with the
        decision that says why."""

        def open_on(site: SiteState) -> Dispatch:
            return self.open_dispatch(prepared, site, started_at=started, admission=part)

        decision = self.router.decide(prepared)
        if decision.site is not None:
            self.router.count(decision)
            # Built (and counted on its site) before any await: the next request of a burst,
            # and the next prompt of this one, must see it.
            return open_on(decision.site), decision
        if self.queue.takes(decision) and (placed := await self.queue.wait(prepared, open_on)):
            return placed
        self.router.count(decision)
        return None, decision

    def open_dispatch(
        self,
        prepared: PreparedCompletion,
        site: SiteState,
        started_at: float | None = None,
        admission: AdmissionPart | None = None,
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
            lengths=self.prediction,
        )

    async def drain(self) -> None:
        await self.queue.close()
        await self.records.drain()
