"""The fine-tuning API's operations: create, list, retrieve, cancel, events and checkpoints,
each scoped to the caller's key (another key's job is the 404 of an unknown one).

A job is refused, nothing made, unless its model is a base model that a site serving it trains
jobs of, its files the caller's own of purpose `fine-tune` within
GATEWAY_FINE_TUNING_MAX_FILE_BYTES, and its key within its training limits
(gateway/fine_tuning/limits.py; the checks this gateway holds of the key's jobs count too). It
is then made `validating_files` (in the transaction that checks the key's limits, so the check
counts it at once) and its files are checked, once, in their own processes, in its key's turn
(gateway/fine_tuning/checker.py), with the lines longer than the context, or than one example
the memory reserve of the training sites of its base holds. The request waits for the check and
answers the job queued, or 400 naming the bad lines; the job is then failed, and counts against
its key (issue 67). The check ends whatever becomes of the request (a client gone does not leave
its job validating), unless the job is cancelled: its check then stops at once (issue 75), and
`run` stops the checks here of jobs cancelled through another gateway of the database. The
runner (gateway/fine_tuning/runner.py) hands a queued job to a site.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from functools import partial

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admin.adapters import AdapterAdmin
from gateway.batch_settings import FineTuningSettings
from gateway.db.models import FineTuningStatus
from gateway.errors import GatewayError, NotFound, invalid_request
from gateway.files.service import file_too_large
from gateway.fine_tuning.checker import CheckCancelled, CheckedFile, FileChecker
from gateway.fine_tuning.file_check import LengthLimit
from gateway.fine_tuning.limits import TrainingLimits, estimated_tokens, window_start
from gateway.fine_tuning.request import JobCreateRequest, resolve
from gateway.fine_tuning.runner import FineTuningRunner
from gateway.metrics import GatewayMetrics
from gateway.model_catalogue import AdapterCatalogue
from gateway.sites.interface import SiteCallError
from gateway.sites.registry import SiteRegistry
from gateway.stores.file_store import FINE_TUNE_PURPOSE, FileStore, FileView
from gateway.stores.fine_tuning_store import (
    CheckpointView,
    EventView,
    FineTuningStore,
    JobUse,
    JobView,
    NewJob,
)
from gateway.stores.pages import Owner, Page
from gateway.tenancy.keys import KeyRecord

log = logging.getLogger(__name__)

JOB_PREFIX = "ftjob-"
MAX_PAGE = 100
# What an id of this API can be (a job's, an event's, a checkpoint's): anything else names
# nothing, and is answered so without a query (a NUL, say, PostgreSQL would refuse).
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_after(after: str | None) -> None:
    if after is not None and not _ID.fullmatch(after):
        raise invalid_request(f"after: no such id '{after[:64]}'", param="after")


def job_not_found(job_id: str) -> GatewayError:
    return NotFound(
        f"No such fine-tuning job: {job_id}",
        param="fine_tuning_job_id",
        code="fine_tuning_job_not_found",
    )


class FineTuningService:
    def __init__(
        self,
        store: FineTuningStore,
        files: FileStore,
        runner: FineTuningRunner,
        base_models: Mapping[str, str],
        settings: FineTuningSettings,
    ) -> None:
        self.store = store
        self._files = files
        self.runner = runner
        self._bases = dict(base_models)  # base model: its tokenizer's directory
        self._max_file_bytes = settings.max_file_bytes
        self._poll_s = settings.poll_s
        self._limits = TrainingLimits(
            settings.jobs_per_key, settings.tokens_per_key_day, settings.validations_per_key
        )
        # Its processes, by key turns (the tests read how many run).
        self.checker = FileChecker(settings.validation_workers, settings.validation_cpu_share)
        # Jobs made here take turns (the key's row lock orders them across gateways; on
        # SQLite, which has no row locks, one gateway's turns are the only order).
        self._admitting = asyncio.Lock()
        self._checks: set[asyncio.Task[JobView]] = set()

    @classmethod
    def build(
        cls,
        sessions: async_sessionmaker[AsyncSession],
        registry: SiteRegistry,
        catalogue: AdapterCatalogue,
        adapters: AdapterAdmin,
        metrics: GatewayMetrics,
        base_models: Mapping[str, str],
        settings: FineTuningSettings,
    ) -> FineTuningService:
        store, files = FineTuningStore(sessions), FileStore(sessions)
        runner = FineTuningRunner(
            store,
            files,
            registry,
            catalogue,
            adapters,
            metrics,
            settings.poll_s,
            settings.start_timeout_s,
            settings.validation_timeout_s,
        )
        return cls(store, files, runner, base_models, settings)

    async def run(self) -> None:
        """Starts the checking processes once a site trains jobs (a create then waits for no
        process to start), and every GATEWAY_FINE_TUNING_POLL_S stops the checks here of jobs
        no longer validating (cancelled through another gateway of the database)."""
        warm = False
        while True:
            trained = [base for base in self._bases if self.runner.training_sites(base)]
            if trained and not warm:
                self.checker.warm(self._bases[base] for base in trained)
                warm = True
            held = self.checker.job_ids()
            if held:
                placed = await self.store.placements(held)
                for job_id, (status, _) in placed.items():
                    if status is not FineTuningStatus.VALIDATING_FILES:
                        await self.checker.cancel(job_id)
            await asyncio.sleep(self._poll_s)

    async def close(self) -> None:
        await self.checker.close()

    async def create(
        self, request: JobCreateRequest, owner: Owner, key: KeyRecord | None
    ) -> asyncio.Future[JobView]:
        """The job made and its check begun: a future of the job, queued once checked (400 for
        a bad line in either file: the job made, and failed). Refused at once, nothing made:
        400 for a model no site trains, a file that is not the caller's fine-tune file, a file
        past GATEWAY_FINE_TUNING_MAX_FILE_BYTES; 429 for a key at its training limits
        (limits.py). Awaiting the future may be given up (the client went away) without
        stopping the check."""
        self._check_model(request.model)
        training_view = await self._file(request.training_file, owner, "training_file")
        validation_view = None
        if request.validation_file is not None:
            validation_view = await self._file(request.validation_file, owner, "validation_file")
        size = training_view.bytes + (validation_view.bytes if validation_view else 0)
        if size > self._max_file_bytes:
            param = (
                "validation_file"
                if training_view.bytes <= self._max_file_bytes
                else "training_file"
            )
            raise file_too_large(param, size, self._max_file_bytes)
        who = f"API key {key.prefix}... ('{key.name}')" if key is not None else "this caller"
        tokens_per_minute = key.tokens_per_minute if key is not None else None
        # Its epochs and rate depend on no example; its batch size is set again once its
        # examples are counted.
        provisional = resolve(request.hyperparameters, 1)
        wanted = estimated_tokens(training_view.bytes, provisional.n_epochs)

        def admit(uses: list[JobUse]) -> None:
            checking = self.checker.held(owner)
            self._limits.check(who, tokens_per_minute, uses, wanted, checking)

        new = NewJob(
            f"{JOB_PREFIX}{uuid.uuid4().hex[:24]}",
            owner,
            key.name if key is not None else None,
            request.model,
            request.training_file,
            request.validation_file,
            request.suffix,
            request.seed if request.seed is not None else random.randrange(2**31),
            provisional.n_epochs,
            provisional.batch_size,
            provisional.learning_rate_multiplier,
        )
        async with self._admitting:
            job = await self.store.create(new, admit, window_start())
        if job is None:  # a file deleted while it was looked at
            raise _no_file(request.training_file, "training_file")
        check = asyncio.ensure_future(self._validate(job, request))
        self._checks.add(check)
        check.add_done_callback(self._check_done)
        return asyncio.shield(check)

    def _check_done(self, check: asyncio.Task[JobView]) -> None:
        self._checks.discard(check)
        if not check.cancelled():
            check.exception()  # its request's to raise; seen here too, for a request gone

    async def _validate(self, job: JobView, request: JobCreateRequest) -> JobView:
        """Checks the job's files and moves it on: queued, or failed with the check's error."""
        files = [CheckedFile("training_file", partial(self._parts, job, "training_file"))]
        if job.validation_file is not None:
            files.append(
                CheckedFile("validation_file", partial(self._parts, job, "validation_file"))
            )
        try:
            limit = self._length_limit(job.model)
            summary = await self.checker.check(job.owner, job.id, files, limit)
        except CheckCancelled:
            return await self.get(job.id, job.owner)
        except GatewayError as exc:
            error = {"code": exc.code or "validation_failed", "message": exc.message,
                     "param": exc.param}  # fmt: skip
            await self.store.finish(
                job.id, FineTuningStatus.FAILED, f"Fine-tuning job failed: {exc.message}",
                error=error,
            )  # fmt: skip
            raise
        batch_size = resolve(request.hyperparameters, summary.examples).batch_size
        validated = await self.store.validated(job.id, batch_size, summary.examples)
        if validated is None:  # cancelled while its files were checked
            return await self.get(job.id, job.owner)
        log.info("fine-tuning job %s created for %s (%d examples)",
                 job.id, job.model, summary.examples)  # fmt: skip
        self.runner.wake()
        return validated

    def _length_limit(self, model: str) -> LengthLimit | None:
        """The context and the example's tokens in the memory reserve that every training site
        of the base holds (None: none says its context)."""
        infos = [s.info for s in self.runner.training_sites(model) if s.info is not None]
        contexts = [info.max_model_len for info in infos if info.max_model_len > 0]
        reserves = [
            i.fine_tuning_max_example_tokens for i in infos if i.fine_tuning_max_example_tokens
        ]
        if not contexts:
            return None
        return LengthLimit(self._bases[model], min(contexts), min(reserves, default=None))

    def _check_model(self, model: str) -> None:
        if model not in self._bases:
            raise invalid_request(
                f"model {model!r} is not a base model served here: fine-tuning starts from one "
                f"of {', '.join(sorted(self._bases)) or 'none'}",
                param="model",
                code="model_not_found",
            )
        if not self.runner.training_sites(model):
            raise invalid_request(
                f"no site serving {model!r} accepts fine-tuning jobs",
                param="model",
                code="model_not_available",
            )

    async def _file(self, file_id: str, owner: Owner, param: str) -> FileView:
        view = await self._files.get(file_id, owner)
        if view is None:
            raise _no_file(file_id, param)
        if view.purpose != FINE_TUNE_PURPOSE:
            raise invalid_request(
                f"{param}: file {file_id} has purpose {view.purpose!r}; upload training data "
                f"with purpose {FINE_TUNE_PURPOSE!r}",
                param=param,
                code="invalid_file_purpose",
            )
        return view

    async def _parts(self, job: JobView, param: str) -> AsyncIterator[bytes]:
        """The bytes of the job's file `param`, a part at a time, as its check reads them."""
        file_id = job.training_file if param == "training_file" else job.validation_file
        parts = await self._files.parts(file_id or "", job.owner)
        if parts is None:
            raise _no_file(file_id or "", param)  # deleted since it was looked at
        async for part in parts:
            yield part

    async def get(self, job_id: str, owner: Owner) -> JobView:
        job = await self.store.get(job_id, owner) if _ID.fullmatch(job_id) else None
        if job is None:
            raise job_not_found(job_id)
        return job

    async def list_jobs(self, owner: Owner, after: str | None, limit: int) -> Page[JobView]:
        _check_limit(limit)
        _check_after(after)
        page = await self.store.list_jobs(owner, after, limit)
        if page is None:
            raise invalid_request(f"after: no fine-tuning job with id '{after}'", param="after")
        return page

    async def _check_job_page(
        self, job_id: str, owner: Owner, after: str | None, limit: int
    ) -> None:
        """A page of the job's events or checkpoints may be read: its bounds, and the job is the
        caller's (404 otherwise)."""
        _check_limit(limit)
        _check_after(after)
        await self.get(job_id, owner)

    async def events(
        self, job_id: str, owner: Owner, after: str | None, limit: int
    ) -> Page[EventView]:
        await self._check_job_page(job_id, owner, after, limit)
        return await self.store.events(job_id, after, limit)

    async def checkpoints(
        self, job_id: str, owner: Owner, after: str | None, limit: int
    ) -> Page[CheckpointView]:
        await self._check_job_page(job_id, owner, after, limit)
        return await self.store.checkpoints(job_id, after, limit)

    async def cancel(self, job_id: str, owner: Owner) -> JobView:
        """Cancels the job at its site (if one has it) and here; 400 for a final job, which
        never changes again."""
        job = await self.get(job_id, owner)
        if job.status.is_final:
            raise invalid_request(
                f"fine-tuning job {job_id} is {job.status.value} already; a "
                "finished job cannot be cancelled",
                param="fine_tuning_job_id",
                code="job_not_cancellable",
            )
        message = "Fine-tuning job cancelled"
        if job.status is FineTuningStatus.VALIDATING_FILES:
            await self.store.finish(job_id, FineTuningStatus.CANCELLED, message)
            await self.checker.cancel(job_id)  # it stops at once (issue 75)
            return await self.get(job_id, owner)
        if job.site is not None:
            try:
                await self.runner.cancel_at_site(job)
            except SiteCallError as exc:
                # Cancelled here all the same: its adapter is never served, and the runner's
                # reconciliation cancels it at the site once the site answers (and says so in
                # the job's events).
                message += (
                    f" (site {job.site} could not be told: {exc.detail}; it is told again "
                    "until it confirms)"
                )
        await self.store.finish(job_id, FineTuningStatus.CANCELLED, message)
        return await self.get(job_id, owner)


def _no_file(file_id: str, param: str) -> GatewayError:
    return invalid_request(f"{param}: no such file: {file_id}", param=param, code="file_not_found")


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise invalid_request(f"limit must be in 1..{MAX_PAGE}", param="limit")
