"""One batch item's life on this gateway: prepared (on the tokenize pool) as its endpoint's
request, started, run through the same dispatch as an online request of that endpoint, tried
again after a server-side failure, and recorded final. Every write is fenced by the item's
attempts (gateway/batches/store.py), so a gateway that lost the item writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

import msgspec

from gateway.batches.items import ItemPreparer
from gateway.batches.plan import retry_delay_s
from gateway.batches.records import ItemResult, QueuedItem
from gateway.batches.request import CHAT, COMPLETIONS
from gateway.batches.settling import CANCELLED_ERROR
from gateway.batches.store import BatchStore
from gateway.chat.result import collect_chat_completion
from gateway.completions.result import collect_completion
from gateway.db.models import BatchItemStatus, RequestStatus
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError, InternalFailure, service_unavailable
from gateway.request_path.predict import with_predicted_length
from gateway.request_path.record import accepted_request
from gateway.request_path.service import CompletionService
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import Outcome
from gateway.tenancy.keys import KeyRecord
from gateway.tokenize_pool import TokenizePool

log = logging.getLogger(__name__)
T = TypeVar("T")
ROUTING_POLICY = "mico_batch"
# The HTTP status a failed item's endpoint would have answered (the API layer's mapping).
StatusOf = Callable[[GatewayError], int]


async def to_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Runs `work` to its end even when the caller is cancelled meanwhile (it is a write that
    must land whole); the caller's cancellation is raised once it has ended."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the work itself was cancelled (the loop is closing)
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


@dataclass(slots=True)
class BatchRun:
    """A batch this gateway runs: what its items need to know of it, and how it is being
    stopped."""

    batch_id: str
    model: str = ""
    endpoint: str = COMPLETIONS
    api_key_id: int | None = None
    # The key's record (its concurrency cap bounds the batch's items too); None without a key.
    key: KeyRecord | None = None
    expires_at: datetime | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None  # in_progress_at
    # Seconds its remaining items are estimated to take (gateway/batches/progress.py), for the
    # feed's deadline promotion; None until estimated.
    eta_s: float | None = None
    task: asyncio.Task[None] | None = None
    # Set when the batch itself is stopped (cancelled, expired), as opposed to this gateway
    # stopping; its running items are then recorded with `stop_error`.
    cancelling: bool = False
    stop_error: dict[str, object] = dataclass_field(default_factory=lambda: CANCELLED_ERROR)
    # Writing its files: nothing stops that but this gateway stopping.
    finalizing: bool = False


class ItemRunner:
    def __init__(
        self,
        settings: GatewaySettings,
        store: BatchStore,
        completions: CompletionService,
        registry: SiteRegistry,
        preparer: ItemPreparer,
        pool: TokenizePool,
        status_of: StatusOf,
    ) -> None:
        self._settings = settings
        self._store = store
        self._completions = completions
        self._registry = registry
        self._preparer = preparer
        self._pool = pool
        self._status_of = status_of

    async def run(self, run: BatchRun, item: QueuedItem) -> None:
        """Starts the item, again after a server-side failure, until it is recorded final;
        writes nothing once the item was cancelled or started by another gateway.

        One outcome wins, in the item and in its request row alike: the answer's, once its
        dispatch has ended (completed, or failed for good), even if the batch is cancelled while
        the item is being recorded; the cancel's, if it stops the answer first (the dispatch
        then records its request cancelled, with the tokens it took)."""
        attempts, started = item.attempts, False
        try:
            while True:
                try:
                    prepared = await self.prepare(run, item)
                except GatewayError as exc:  # the gateway's configuration changed since submit
                    result = self._failed(exc)
                    break
                if not await self._store.start_item(
                    run.batch_id, item.index, attempts, prepared.request_id
                ):
                    return
                attempts, started = attempts + 1, True
                outcome = await self._attempt(run, item, prepared)
                if isinstance(outcome, ItemResult):
                    result = outcome
                    break
                if not outcome.retryable or attempts >= self._settings.batches.max_attempts:
                    result = self._failed(outcome)
                    break
                log.warning("batch %s item %d: %s; again", run.batch_id, item.index, outcome)
                await asyncio.sleep(retry_delay_s(attempts))
        except asyncio.CancelledError:
            if run.cancelling and started:
                stopped = ItemResult(BatchItemStatus.CANCELLED, error=run.stop_error)
                await to_the_end(self._finish(run, item, attempts, stopped))
            raise
        # From here on the outcome is reached: a cancel arriving now waits for it to be recorded.
        await to_the_end(self._finish(run, item, attempts, result, started=started))

    def _failed(self, exc: GatewayError) -> ItemResult:
        return ItemResult(
            BatchItemStatus.FAILED, error=exc.fields(), status_code=self._status_of(exc)
        )

    async def _attempt(
        self, run: BatchRun, item: QueuedItem, prepared: PreparedCompletion
    ) -> ItemResult | GatewayError:
        """One start of the item: its completion, or the error it failed with."""
        try:
            completion = await self._dispatch(run, item, prepared)
        except GatewayError as exc:
            return exc
        except Exception as exc:  # e.g. the database went away while recording the request
            log.exception("batch %s item %d failed", run.batch_id, item.index)
            return InternalFailure(f"internal error: {type(exc).__name__}")
        return ItemResult(BatchItemStatus.COMPLETED, completion=completion)

    async def _finish(
        self,
        run: BatchRun,
        item: QueuedItem,
        attempts: int,
        result: ItemResult,
        started: bool = True,
    ) -> None:
        await self._store.finish_item(run.batch_id, item.index, attempts, result, started=started)

    async def prepare(self, run: BatchRun, item: QueuedItem) -> PreparedCompletion:
        """The item as its endpoint's request, prepared on the tokenize pool, with the answer
        length its assignment planned."""
        prepare = partial(self._preparer.prepare, run.endpoint, run.model)
        prepared = await self._pool.run(prepare, item.body)
        # The owner is checked at submission; again here, as the federation file may have
        # changed hands since (a restart).
        key_name = run.key.name if run.key is not None else None
        self._completions.preparer.check_owner(prepared, run.api_key_id, key_name)
        prepared = self._completions.preparer.salted(prepared, run.api_key_id)
        if item.predicted_tokens is None:
            return prepared
        return with_predicted_length(prepared, item.predicted_tokens, item.predicted_bucket)

    def _site(self, item: QueuedItem, prepared: PreparedCompletion) -> SiteState | None:
        """The assigned site while it is healthy and not drained; else what the routing policy
        picks now."""
        assigned = next((s for s in self._registry.all() if s.site_id == item.site_id), None)
        if assigned is not None and assigned.healthy and not assigned.draining:
            return assigned
        tried = {assigned.name} if assigned is not None else set()
        return self._completions.router.reroute(prepared, tried)

    async def _dispatch(
        self, run: BatchRun, item: QueuedItem, prepared: PreparedCompletion
    ) -> dict[str, object]:
        """Runs the item on its site; its completion object as stored."""
        site = self._site(item, prepared)
        if site is None:
            raise service_unavailable(f"no site can serve model '{run.model}' now")
        accepted = self._completions.records.request_log.accepted(
            accepted_request(
                prepared,
                api="batch",
                routing_policy=ROUTING_POLICY,
                site=site,
                api_key_id=run.api_key_id,
                predictor_version=item.predictor_version,
                routing_detail={
                    "batch_id": run.batch_id,
                    "custom_id": item.custom_id,
                    "assigned_site_id": item.site_id,
                    "assignment": item.assign_reason,
                },
            )
        )
        try:
            await accepted
        except asyncio.CancelledError:
            # The row may be written already; Dispatch records cancellations only from here on.
            outcome = Outcome(RequestStatus.CANCELLED, site.site_id, 1, error="batch cancelled")
            self._completions.records.outcomes.record_finished(prepared.request_id, outcome)
            raise
        dispatch = self._completions.open_dispatch(prepared, site)
        if run.endpoint == CHAT:
            chat = await collect_chat_completion(dispatch)
            return dict(msgspec.to_builtins(chat))
        return dict(msgspec.to_builtins(await collect_completion(dispatch)))
