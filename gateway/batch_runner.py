"""Runs accepted batches: claims them in the database, assigns their items with MICO's group-wise
algorithm, dispatches them through the regular completion path, and resumes after a restart.

A batch goes through three steps, each restartable from what the database holds:
1. recover: items the previous owner left running are queued again (an item recorded final is
   never run again; see the fencing in gateway/services/batches.py);
2. assign (while `validating`): every item's length is predicted and `mico_assign` places the
   batch over the healthy sites serving its model; the site, planned tokens and reason are
   stored with each item;
3. run: one lane per assigned site, each with `batch_site_concurrency` workers sharing that
   site's slots with every other batch, so a batch of 100k items keeps only a few streams per
   site open. Each item goes through Dispatch (ledger, failover, offload, request log), like a
   /v1/completions request that the batch's assignment routed.

Cancellation stops a batch's tasks; items that were running are then recorded cancelled. A
gateway that stops leaves its running items running in the database and releases its leases,
so the next gateway to look (or this one, restarted) resumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import deque
from dataclasses import dataclass, field, replace

import msgspec

from gateway.api.batch_schemas import completion_request
from gateway.api.errors import OpenAIError, service_unavailable
from gateway.api.openai_format import collect_completion
from gateway.api.schemas import Completion
from gateway.batch_plan import PlanItem, plan_batch, retry_delay_s, retryable
from gateway.completions import CompletionService, PreparedCompletion
from gateway.db.models import BatchItemStatus, BatchStatus, RequestStatus
from gateway.dispatch import Dispatch
from gateway.prediction import Prediction
from gateway.routing.types import UnpredictedPlan
from gateway.services.batch_leases import BatchLeases
from gateway.services.batch_records import ItemAssignment, ItemResult, LaneKey, QueuedItem
from gateway.services.batches import CANCELLED_ERROR, OPEN_BATCH, BatchStore
from gateway.services.request_log import NewRequest, Outcome
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)
ROUTING_POLICY = "mico_batch"
# Batches one gateway runs at once; more wait in the database, oldest first.
MAX_ACTIVE_BATCHES = 8
# Items read per database round trip while assigning (and predicted concurrently).
_ASSIGN_PAGE = 512


@dataclass(slots=True)
class _Run:
    batch_id: str
    model: str = ""
    task: asyncio.Task[None] | None = None
    # Set when the batch itself is cancelled, as opposed to this gateway stopping.
    cancelling: bool = False


@dataclass(slots=True)
class _LaneCursor:
    """Queued items of one (batch, site), read a page at a time in lane order (longest planned
    answer first)."""

    store: BatchStore
    batch_id: str
    site_id: int | None
    page: int
    unpredicted: UnpredictedPlan
    after: LaneKey | None = None
    exhausted: bool = False
    buffer: deque[QueuedItem] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def next(self) -> QueuedItem | None:
        async with self.lock:
            if not self.buffer and not self.exhausted:
                rows = await self.store.lane(
                    self.batch_id, self.site_id, self.after, self.page, self.unpredicted
                )
                self.exhausted = len(rows) < self.page
                if rows:
                    self.after = rows[-1].lane_key(self.unpredicted)
                self.buffer.extend(rows)
            return self.buffer.popleft() if self.buffer else None


def _error(exc: OpenAIError) -> dict[str, object]:
    return {k: v for k, v in msgspec.structs.asdict(exc.body).items() if v is not None}


def _failed(exc: OpenAIError) -> ItemResult:
    return ItemResult(BatchItemStatus.FAILED, error=_error(exc))


def _plan_item(
    item: QueuedItem, prediction: Prediction | None, unpredicted: UnpredictedPlan
) -> PlanItem:
    if prediction is None:
        return PlanItem(item.index, item.prompt_tokens, item.max_tokens, unpredicted=unpredicted)
    tokens = min(prediction.tokens, item.max_tokens)  # the site stops at max_tokens anyway
    return PlanItem(item.index, item.prompt_tokens, item.max_tokens, tokens, prediction.bucket)


class BatchRunner:
    def __init__(
        self,
        settings: GatewaySettings,
        store: BatchStore,
        leases: BatchLeases,
        completions: CompletionService,
        registry: SiteRegistry,
    ) -> None:
        self._settings = settings
        self._store = store
        self._leases = leases
        self._completions = completions
        self._registry = registry
        self.owner = f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._runs: dict[str, _Run] = {}
        self._slots: dict[int | None, asyncio.Semaphore] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def poll_s(self) -> float:
        return self._settings.batch_lease_s / 3

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="batch-runner")

    def wake(self) -> None:
        """A batch was submitted: look now rather than at the next poll."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stops this gateway's tasks of a batch whose cancel was recorded."""
        run = self._runs.get(batch_id)
        if run is not None and run.task is not None and not run.cancelling:
            run.cancelling = True
            run.task.cancel()

    async def stop(self) -> None:
        """Stops every task and hands the batches back (their running items resume elsewhere)."""
        held = list(self._runs)
        tasks = [t for t in (self._task, *(r.task for r in self._runs.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._leases.release(self.owner, held)
        except Exception:  # the leases lapse on their own; another gateway resumes then
            log.exception("could not release batch leases")
        self._runs.clear()

    async def _supervise(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # the database may be down for a moment: try again next time
                log.exception("batch runner: renewing or claiming batches failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    async def _tick(self) -> None:
        lease_s = self._settings.batch_lease_s
        held = await self._leases.renew(self.owner, list(self._runs), lease_s)
        for batch_id, run in list(self._runs.items()):
            status = held.get(batch_id)
            if status == BatchStatus.CANCELLING:
                self.cancel(batch_id)  # cancelled through another gateway
            elif status is None and run.task is not None and not run.task.done():
                # Settled (its last tasks are ending) or, after a lapsed lease, another
                # gateway's now: either way nothing of it is left for this one to do.
                log.info("batch %s is no longer held by this gateway; stopping it", batch_id)
                run.task.cancel()
                del self._runs[batch_id]
        room = MAX_ACTIVE_BATCHES - len(self._runs)
        if room > 0:
            for batch_id in await self._leases.claim(self.owner, lease_s, room):
                run = _Run(batch_id)
                run.task = asyncio.create_task(self._run(run), name=f"batch-{batch_id}")
                self._runs[batch_id] = run

    async def _run(self, run: _Run) -> None:
        try:
            await self._run_batch(run)
        except asyncio.CancelledError:
            if not run.cancelling:
                raise  # this gateway stops (stop() hands the batch back) or lost the lease
        except Exception:
            log.exception("batch %s failed to run; handing it back", run.batch_id)
        # A settled batch has no owner any more; anything else is taken up again at a poll.
        self._runs.pop(run.batch_id, None)
        with contextlib.suppress(Exception):
            await self._leases.release(self.owner, [run.batch_id])

    async def _run_batch(self, run: _Run) -> None:
        batch = await self._leases.recover(run.batch_id)
        if batch is None or batch.status not in OPEN_BATCH:
            return
        run.model = batch.model
        if batch.status == BatchStatus.VALIDATING:
            await self._assign(run)
            if not await self._store.begin_progress(run.batch_id):
                return  # cancelled while being assigned
            log.info("batch %s: %d items assigned", run.batch_id, batch.total)
        # A task group, not gather: when one lane fails (the database went away), the others
        # stop too, so no item keeps running after the batch is handed back.
        async with asyncio.TaskGroup() as lanes:
            for site_id in await self._store.lanes(run.batch_id):
                lanes.create_task(self._lane(run, site_id))

    async def _assign(self, run: _Run) -> None:
        plan: list[PlanItem] = []
        versions: dict[int, str] = {}
        unpredicted = self._settings.plan_without_prediction
        after = -1
        while page := await self._store.queued(run.batch_id, after, _ASSIGN_PAGE):
            after = page[-1].index
            predicted = await asyncio.gather(*(self._predict(run.model, q) for q in page))
            for queued, prediction in zip(page, predicted, strict=True):
                plan.append(_plan_item(queued, prediction, unpredicted))
                if prediction is not None:
                    versions[queued.index] = prediction.version
        placements = plan_batch(run.model, plan, self._registry.all())
        assignments = [
            ItemAssignment(
                index=item.index,
                site_id=placement.site_id,
                predicted_tokens=item.predicted_tokens,
                predicted_bucket=item.predicted_bucket,
                predictor_version=versions.get(item.index),
                reason=placement.reason,
            )
            for item, placement in zip(plan, placements, strict=True)
        ]
        await self._store.assign(run.batch_id, assignments)

    async def _predict(self, model: str, item: QueuedItem) -> Prediction | None:
        if self._completions.predictors.version(model) is None:
            return None  # fallback mode: no need to tokenize the prompt again
        try:
            prompt = self._completions.prepare(completion_request(model, item.body)).prompt_text
        except OpenAIError:
            return None  # it no longer validates: it fails with the reason when it starts
        return await self._completions.predictors.predict(model, prompt)

    async def _lane(self, run: _Run, site_id: int | None) -> None:
        concurrency = self._settings.batch_site_concurrency
        cursor = _LaneCursor(
            self._store,
            run.batch_id,
            site_id,
            page=2 * concurrency,
            unpredicted=self._settings.plan_without_prediction,
        )
        slots = self._slots.setdefault(site_id, asyncio.Semaphore(concurrency))

        async def worker() -> None:
            while (item := await cursor.next()) is not None:
                async with slots:
                    await self._run_item(run, item)

        async with asyncio.TaskGroup() as workers:
            for _ in range(concurrency):
                workers.create_task(worker())

    async def _run_item(self, run: _Run, item: QueuedItem) -> None:
        """Starts the item, again after a server-side failure, until it is recorded final;
        writes nothing once the item was cancelled or started by another gateway."""
        attempts, started = item.attempts, False
        try:
            while True:
                try:
                    prepared = self._prepare(run.model, item)
                except OpenAIError as exc:  # the gateway's configuration changed since submit
                    await self._finish(run, item, attempts, _failed(exc), started=started)
                    return
                if not await self._store.start_item(
                    run.batch_id, item.index, attempts, prepared.request_id
                ):
                    return
                attempts, started = attempts + 1, True
                outcome = await self._attempt(run, item, prepared)
                if isinstance(outcome, ItemResult):
                    await self._finish(run, item, attempts, outcome)
                    return
                if not retryable(outcome.status) or attempts >= self._settings.batch_max_attempts:
                    await self._finish(run, item, attempts, _failed(outcome))
                    return
                log.warning("batch %s item %d: %s; again", run.batch_id, item.index, outcome)
                await asyncio.sleep(retry_delay_s(attempts))
        except asyncio.CancelledError:
            if run.cancelling and started:
                result = ItemResult(BatchItemStatus.CANCELLED, error=CANCELLED_ERROR)
                await self._finish(run, item, attempts, result)
            raise

    async def _attempt(
        self, run: _Run, item: QueuedItem, prepared: PreparedCompletion
    ) -> ItemResult | OpenAIError:
        """One start of the item: its completion, or the error it failed with."""
        try:
            completion = await self._dispatch(run, item, prepared)
        except OpenAIError as exc:
            return exc
        except Exception as exc:  # e.g. the database went away while recording the request
            log.exception("batch %s item %d failed", run.batch_id, item.index)
            return OpenAIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return ItemResult(BatchItemStatus.COMPLETED, completion=msgspec.to_builtins(completion))

    async def _finish(
        self, run: _Run, item: QueuedItem, attempts: int, result: ItemResult, started: bool = True
    ) -> None:
        await self._store.finish_item(run.batch_id, item.index, attempts, result, started=started)

    def _prepare(self, model: str, item: QueuedItem) -> PreparedCompletion:
        prepared = self._completions.prepare(completion_request(model, item.body))
        if item.predicted_tokens is None:
            return prepared
        params = replace(prepared.params, predicted_tokens=item.predicted_tokens)
        return replace(prepared, params=params, predicted_bucket=item.predicted_bucket)

    def _site(self, item: QueuedItem, prepared: PreparedCompletion) -> SiteState | None:
        """The assigned site while it is healthy and not drained; else what the routing policy
        picks now."""
        assigned = next((s for s in self._registry.all() if s.site_id == item.site_id), None)
        if assigned is not None and assigned.healthy and not assigned.draining:
            return assigned
        tried = {assigned.name} if assigned is not None else set()
        return self._completions.reroute(prepared, tried)

    async def _dispatch(
        self, run: _Run, item: QueuedItem, prepared: PreparedCompletion
    ) -> Completion:
        site = self._site(item, prepared)
        if site is None:
            raise service_unavailable(f"no site can serve model '{run.model}' now")
        params = prepared.params
        accepted = self._completions.request_log.accepted(
            NewRequest(
                request_id=prepared.request_id,
                api="batch",
                model=prepared.model,
                stream=False,
                user=prepared.user,
                prompt_tokens=len(params.prompt_token_ids),
                max_tokens=params.max_tokens,
                routing_policy=ROUTING_POLICY,
                site_id=site.site_id,
                predicted_tokens=params.predicted_tokens,
                predicted_bucket=prepared.predicted_bucket,
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
            self._completions.record_later(prepared.request_id, outcome)
            raise
        return await collect_completion(Dispatch(self._completions, prepared, site))
