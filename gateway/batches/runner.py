"""Runs accepted batches: claims them in the database, assigns their items with MICO's group-wise
algorithm, dispatches them through the regular completion path, and resumes after a restart.

A batch goes through three steps, each restartable from what the database holds:
1. recover: items the previous owner left running are queued again (an item recorded final is
   never run again; see the fencing in gateway/batches/store.py);
2. assign (while `validating`): every item's length is predicted (and its prompt's prefix
   blocks hashed, for the prefix-tree orders) and the batch plan (gateway/batches/plan.py) gives
   each item its site and its rank in that site's order; the site, planned tokens, reason and
   rank are stored with each item;
3. run: one lane per assigned site reads its items in rank order, a page at a time, and starts
   each when the site's feed (gateway/batches/feed.py) grants a place: the feed keeps each site
   supplied with just enough batch work for its idle capacity, all batches together, and lets a
   batch near its deadline go first, so a batch of 100k items keeps only a few streams per site
   open. Each item goes through Dispatch (ledger, failover, offload, request log), like a
   /v1/completions request that the batch's assignment routed.

4. finalize: once every item is final, the output and error files are written and the batch
   settles (gateway/batches/finalize.py).

Items are prepared (validated and tokenized) again at each start, on the tokenize pool, never on
the event loop. Each item's request row carries the batch's key, so usage per key counts it, and
each running item holds one of the key's concurrency slots (max_concurrent_requests), waiting
for one while the key is at its cap.

Cancellation stops a batch's tasks; items that were running are then recorded cancelled. So
does the end of its completion window (the batch then ends `expired`) and the revocation of its
key (Tenancy.add_revoke_hook: the batch is cancelled). A gateway that stops leaves its running
items running in the database and releases its leases, so the next gateway to look (or this
one, restarted) resumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from datetime import datetime, timedelta
from functools import partial

from gateway.batches.feed import SiteFeed, batch_room, interactive_busy, urgency
from gateway.batches.finalize import BatchFinalizer
from gateway.batches.item_runner import BatchRun, ItemRunner, StatusOf
from gateway.batches.items import ItemPreparer
from gateway.batches.lanes import LaneCursor
from gateway.batches.leases import BatchLeases
from gateway.batches.output import render
from gateway.batches.plan import PlanItem, make_plan
from gateway.batches.progress import estimate
from gateway.batches.records import ItemAssignment, QueuedItem
from gateway.batches.settling import CANCELLED_ERROR, EXPIRED_ERROR, OPEN_BATCH
from gateway.batches.store import BatchStore
from gateway.db.models import BatchStatus, utcnow
from gateway.errors import GatewayError
from gateway.prediction.service import Prediction
from gateway.request_path.service import CompletionService
from gateway.routing.types import UnpredictedPlan
from gateway.settings import GatewaySettings
from gateway.sites.registry import SiteRegistry
from gateway.tenancy.admission import Tenancy
from gateway.tokenize_pool import TokenizePool

log = logging.getLogger(__name__)
# Batches one gateway runs at once; more wait in the database, oldest first.
MAX_ACTIVE_BATCHES = 8
# Prefix blocks of each prompt the prefix-tree orders look at: the whole batch's ids are held
# while it is planned (100k items x 128 blocks is about 0.5 GB of Python ints at most), and
# prompts sharing more than 2,048 tokens (at 16 a block) are rare beyond whole duplicates.
MAX_TREE_BLOCKS = 128
# Items read per database round trip while assigning (and predicted concurrently).
_ASSIGN_PAGE = 512


def _plan_item(
    item: QueuedItem,
    prediction: Prediction | None,
    unpredicted: UnpredictedPlan,
    block_ids: tuple[int, ...],
) -> PlanItem:
    if prediction is None:
        return PlanItem(
            item.index,
            item.prompt_tokens,
            item.max_tokens,
            unpredicted=unpredicted,
            block_ids=block_ids,
        )
    tokens = prediction.within(item.max_tokens)  # the site stops at max_tokens anyway
    return PlanItem(
        item.index,
        item.prompt_tokens,
        item.max_tokens,
        tokens,
        prediction.bucket,
        block_ids=block_ids,
    )


class BatchRunner:
    def __init__(
        self,
        settings: GatewaySettings,
        store: BatchStore,
        leases: BatchLeases,
        completions: CompletionService,
        registry: SiteRegistry,
        *,
        preparer: ItemPreparer,
        pool: TokenizePool,
        finalizer: BatchFinalizer,
        status_of: StatusOf,
        tenancy: Tenancy,
    ) -> None:
        self._settings = settings
        self._tenancy = tenancy
        self._store = store
        self._leases = leases
        self._completions = completions
        self._registry = registry
        self._finalizer = finalizer
        self._items = ItemRunner(settings, store, completions, registry, preparer, pool, status_of)
        self.owner = f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._runs: dict[str, BatchRun] = {}
        self._feeds: dict[int | None, SiteFeed] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._revocations: set[asyncio.Task[None]] = set()

    @property
    def poll_s(self) -> float:
        return self._settings.batches.lease_s / 3

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="batch-runner")

    def wake(self) -> None:
        """A batch was submitted: look now rather than at the next poll."""
        self._wake.set()

    def cancel(self, batch_id: str, error: dict[str, object] = CANCELLED_ERROR) -> None:
        """Stops this gateway's tasks of a batch whose cancel (or expiry) was recorded; its
        running items are recorded with `error`. A batch writing its files is left to finish."""
        run = self._runs.get(batch_id)
        if run is None or run.task is None or run.cancelling or run.finalizing:
            return
        run.cancelling, run.stop_error = True, error
        run.task.cancel()

    def key_revoked(self, key_id: int) -> None:
        """Tenancy's revoke hook: cancels every open batch of the key (through the database, so
        the gateways running them stop them at their next renewal; this one at once)."""
        task = asyncio.create_task(self._cancel_batches_of(key_id), name=f"revoke-{key_id}")
        self._revocations.add(task)
        task.add_done_callback(self._revocations.discard)

    async def _cancel_batches_of(self, key_id: int) -> None:
        try:
            cancelled = await self._store.cancel_owned_by(key_id)
        except Exception:  # a gateway claiming one of them later cancels it (leases.recover)
            log.exception("could not cancel the batches of revoked key %d", key_id)
            return
        for batch_id in cancelled:
            self.cancel(batch_id)
        if cancelled:
            log.info("key %d revoked: cancelled its batches %s", key_id, ", ".join(cancelled))
            self.wake()

    async def stop(self) -> None:
        """Stops every task and hands the batches back (their running items resume elsewhere)."""
        held = list(self._runs)
        tasks = [t for t in (self._task, *(r.task for r in self._runs.values())) if t is not None]
        tasks.extend(self._revocations)
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
        lease_s = self._settings.batches.lease_s
        held = await self._leases.renew(self.owner, list(self._runs), lease_s)
        now = utcnow()
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
            elif (
                run.expires_at is not None
                and run.expires_at <= now
                and not (run.cancelling or run.finalizing)
            ):
                log.info("batch %s: its completion window passed; stopping it", batch_id)
                await self._store.expire(batch_id)
                self.cancel(batch_id, EXPIRED_ERROR)
        await self._estimate(now)
        room = MAX_ACTIVE_BATCHES - len(self._runs)
        if room > 0:
            for batch_id in await self._leases.claim(self.owner, lease_s, room):
                run = BatchRun(batch_id)
                run.task = asyncio.create_task(self._run(run), name=f"batch-{batch_id}")
                self._runs[batch_id] = run

    async def _estimate(self, now: datetime) -> None:
        """Each running batch's time left, for the feeds' deadline promotion."""
        work = await self._store.planned_work(list(self._runs))
        for batch_id, run in self._runs.items():
            if batch_id in work:
                run.eta_s = estimate(*work[batch_id], run.started_at, now).eta_s

    async def _run(self, run: BatchRun) -> None:
        try:
            await self._run_batch(run)
        except asyncio.CancelledError:
            if not run.cancelling:
                raise  # this gateway stops (stop() hands the batch back) or lost the lease
        except Exception:
            log.exception("batch %s failed to run; handing it back", run.batch_id)
        # A settled batch has no owner any more; anything else is taken up again at a poll
        # (a stopped one at once: its files are still to be written).
        self._runs.pop(run.batch_id, None)
        with contextlib.suppress(Exception):
            await self._leases.release(self.owner, [run.batch_id])
        if run.cancelling:
            self.wake()

    async def _run_batch(self, run: BatchRun) -> None:
        batch = await self._leases.recover(run.batch_id)
        if batch is None or batch.status not in OPEN_BATCH:
            return
        run.model, run.endpoint, run.api_key_id = batch.model, batch.endpoint, batch.owner
        run.created_at, run.started_at = batch.created_at, batch.in_progress_at
        if batch.owner is not None:
            run.key = await self._tenancy.keys.get(batch.owner)
        run.expires_at = None if batch.expired_at is not None else batch.expires_at
        run.cancelling = batch.status == BatchStatus.CANCELLING or batch.expired_at is not None
        if batch.status == BatchStatus.VALIDATING:
            await self._assign(run)
            if not await self._store.begin_progress(run.batch_id):
                run.cancelling = True  # cancelled while being assigned: its files next
                return
            run.started_at = utcnow()
            log.info("batch %s: %d items assigned", run.batch_id, batch.total)
        # A task group, not gather: when one lane fails (the database went away), the others
        # stop too, so no item keeps running after the batch is handed back.
        async with asyncio.TaskGroup() as lanes:
            for site_id in await self._store.lanes(run.batch_id):
                lanes.create_task(self._lane(run, site_id))
        run.finalizing = True
        files_expire = utcnow() + timedelta(hours=self._settings.files.retention_h)
        settled = await self._finalizer.finalize(
            run.batch_id,
            partial(render, run.batch_id),
            files_expire,
            lambda: f"file-{uuid.uuid4().hex}",
        )
        if settled is not None:
            log.info("batch %s %s", run.batch_id, settled.status.value)

    async def _assign(self, run: BatchRun) -> None:
        plan: list[PlanItem] = []
        versions: dict[int, str] = {}
        unpredicted = self._settings.routing.plan_without_prediction
        after = -1
        while page := await self._store.queued(run.batch_id, after, _ASSIGN_PAGE):
            after = page[-1].index
            looked = await asyncio.gather(*(self._look(run, q) for q in page))
            for queued, (prediction, block_ids) in zip(page, looked, strict=True):
                plan.append(_plan_item(queued, prediction, unpredicted, block_ids))
                if prediction is not None:
                    versions[queued.index] = prediction.version
        # A LoRA adapter's batch is planned over its base's sites that list the adapter.
        base, adapter = self._completions.preparer.resolve(run.model)
        sites = [s for s in self._registry.all() if adapter is None or adapter in s.adapters]
        # Off the event loop: a prefix tree over 100k items takes seconds (about 3.5 s here).
        placements = await asyncio.to_thread(
            make_plan,
            base,
            plan,
            sites,
            self._settings.batches,
            self._completions.router.policy.batch_cost,
        )
        assignments = [
            ItemAssignment(
                index=item.index,
                site_id=placement.site_id,
                predicted_tokens=item.predicted_tokens,
                predicted_bucket=item.predicted_bucket,
                predictor_version=versions.get(item.index),
                reason=placement.reason,
                rank=placement.rank,
            )
            for item, placement in zip(plan, placements, strict=True)
        ]
        await self._store.assign(run.batch_id, assignments)

    async def _look(
        self, run: BatchRun, item: QueuedItem
    ) -> tuple[Prediction | None, tuple[int, ...]]:
        """What the plan reads of an item beyond its stored lengths: its predicted answer and,
        for the prefix-tree orders, its prompt's block ids (as routing hashes them, salted for
        the batch's key)."""
        predictors = self._completions.prediction.predictors
        batches = self._settings.batches
        wants_blocks = batches.order in ("blend", "dfs")
        if predictors.version(run.model) is None and not wants_blocks:
            return None, ()  # fallback mode: no need to tokenize the prompt again
        try:
            prepared = await self._items.prepare(run, item)
        except GatewayError:
            return None, ()  # it no longer validates: it fails with the reason when it starts
        blocks = (
            prepared.routing.block_ids(batches.blend_block_tokens)[:MAX_TREE_BLOCKS]
            if wants_blocks
            else ()
        )
        if predictors.version(run.model) is None:
            return None, blocks
        return await predictors.predict(run.model, prepared.prompt_text), blocks

    def _feed(self, site_id: int | None) -> SiteFeed:
        """The site's places for batch items, shared by every batch this gateway runs."""
        feed = self._feeds.get(site_id)
        if feed is None:
            cap = self._settings.batches.site_concurrency

            def room(in_flight: int) -> int:
                site = next((s for s in self._registry.all() if s.site_id == site_id), None)
                if site is None:
                    return cap  # no site: the routing policy picks one per item
                busy = interactive_busy(site.report, site.in_flight, in_flight)
                slots = site.info.max_num_seqs if site.info is not None else None
                return batch_room(slots, busy + in_flight, in_flight, cap)

            feed = self._feeds[site_id] = SiteFeed(room)
        return feed

    async def _lane(self, run: BatchRun, site_id: int | None) -> None:
        concurrency = self._settings.batches.site_concurrency
        cursor = LaneCursor(self._store, run.batch_id, site_id, page=2 * concurrency)
        feed = self._feed(site_id)
        margin = self._settings.batches.deadline_margin

        async def worker() -> None:
            while (item := await cursor.next()) is not None:
                # The key's slot first (it may wait), then the site's place: a capped key's
                # items waiting for their key hold no place from the other batches.
                async with self._tenancy.key_slot(run.key):
                    when = urgency(run.expires_at, run.created_at, utcnow(), margin, run.eta_s)
                    async with feed.place(when):
                        await self._items.run(run, item)

        async with asyncio.TaskGroup() as workers:
            for _ in range(concurrency):
                workers.create_task(worker())
